"""What a request's output must match: a JSON schema, any JSON object, or a Lark grammar.

A `StructuredOutput` is a plain, hashable value carried in `SamplingParams`, so it crosses to an
engine process and keys the compiled-grammar cache; `rebar.engine.grammar` turns it into a token
mask. Pure Python (no torch, no grammar library), as the scheduler's side is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from rebar.errors import InvalidRequestError

Kind = Literal["json_object", "json_schema", "lark"]

# A schema or grammar larger than this is refused: compiling one costs time in its size, on the
# thread that serves every request.
MAX_SOURCE_CHARS = 100_000


@dataclass(frozen=True)
class StructuredOutput:
    """`kind` says how to read `source`: for "json_schema" a schema as canonical JSON text, for
    "lark" a Lark grammar, for "json_object" nothing (any JSON object).

    `strict` closes every object the schema leaves open (as OpenAI's strict mode outputs never
    carry keys the schema does not name); without it the schema means what JSON Schema says.
    `param` names the request field it came from, for error messages.
    """

    kind: Kind
    source: str = ""
    strict: bool = False
    param: str = "response_format"

    @classmethod
    def json_schema(
        cls, schema: Any, strict: bool = False, param: str = "response_format"
    ) -> StructuredOutput:
        """A schema given as a dict (or `true`); raises InvalidRequestError when it is not one."""
        if schema is True:
            schema = {}  # JSON Schema's `true`: any value
        if schema is False or not isinstance(schema, dict):
            what = "false (it admits nothing)" if schema is False else type(schema).__name__
            raise InvalidRequestError(f"the JSON schema must be an object, got {what}", param)
        # Key order kept: a schema lists properties in the order the output writes them.
        source = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if len(source) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(
                f"the JSON schema is {len(source)} characters; at most {MAX_SOURCE_CHARS}", param
            )
        return cls("json_schema", source, strict, param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> StructuredOutput:
        return cls("json_object", "", False, param)

    @classmethod
    def lark(cls, grammar: str, param: str = "grammar") -> StructuredOutput:
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidRequestError("the grammar must be a non-empty string", param)
        if len(grammar) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(
                f"the grammar is {len(grammar)} characters; at most {MAX_SOURCE_CHARS}", param
            )
        return cls("lark", grammar, False, param)

    def schema(self) -> Any:
        """The JSON schema this output follows (json_object: any object), strict applied."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json_schema":
            raise ValueError(f"a {self.kind!r} output has no JSON schema")
        schema = json.loads(self.source)
        return closed_objects(schema) if self.strict else schema


# Keywords whose values are schemas, or maps / lists of schemas, that `closed_objects` walks into.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that lists
    properties and says nothing about other keys (a copy; the input is not changed)."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in closed:
            closed[key] = closed_objects(closed[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(sub) for sub in closed[key]]
    if isinstance(closed.get("additionalProperties"), dict):
        closed["additionalProperties"] = closed_objects(closed["additionalProperties"])
    elif "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed
