"""A request's tools, as the model sees them and as the answer is read.

Tools reach the model through its chat template's own `tools` variable, in the format that
template was written for; a template that has none (SmolLM2's, Gemma 3's) gets them in a system
prompt (`FALLBACK_PROMPT`, below) asking for Hermes-style `<tool_call>` blocks. The format the
answer is read in comes from the template and vocabulary (`tool_format`).

The choice: "none" leaves the tools out of the prompt and reads no calls; "auto" (the default with
tools) lets the model answer or call; "required" and a named function force calls by grammar, so
they always parse and their arguments follow each function's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rebar.engine.model_text import ModelText
from rebar.engine.structured import StructuredOutput, closed_objects
from rebar.errors import InvalidRequestError
from rebar.server.pipeline.request import FunctionTool, Tools
from rebar.server.pipeline.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_CALLS,
    PYTHON_TAG,
    Format,
    ToolCallReader,
)

FALLBACK_PROMPT = """You can call functions. Their signatures, as JSON schemas:
<tools>
{tools}
</tools>
To call a function, answer with one block per call, and nothing else:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>"""
NO_ARGUMENTS = {"type": "object", "properties": {}}
# Written with these separators and no other whitespace (engine.grammar.JSON_OPTIONS).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolPlan:
    """What the request's tools do to its prompt, sampling and answer."""

    template_tools: list[dict[str, Any]] | None  # for the template's `tools` variable
    system_prompt: str | None  # the fallback, when the template has no `tools`
    forced: StructuredOutput | None  # the grammar of forced calls
    reader: ToolCallReader | None  # None: the answer is all text


def tool_format(llm: ModelText) -> Format:
    """The tool-call format of this model's template and vocabulary (hermes when it has none)."""
    template = llm.checkpoint.chat_template or ""
    if llm.tokenizer.token_to_id(MISTRAL_CALLS) is not None:
        return "mistral"
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters": dictionary' in template:
        return "llama3_json"
    return "hermes"


def reads_tools(llm: ModelText) -> bool:
    return "tools" in (llm.checkpoint.chat_template or "")


def plan_tools(tools: Tools | None, llm: ModelText) -> ToolPlan | None:
    """None when the request has no tools (or its choice is "none")."""
    if tools is None or tools.choice == "none":
        return None
    forms = [_checked(llm, tool, f"{tools.param}.{i}") for i, tool in enumerate(tools.functions)]
    names = [tool.name for tool in tools.functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("two tools have the same name", tools.param)
    if tools.forced is not None and tools.forced not in names:
        raise InvalidRequestError(
            f"the tool choice names {tools.forced!r}, which is not among the tools",
            tools.choice_param,
        )
    fmt = tool_format(llm)
    forced = None
    if tools.choice == "required" or tools.forced is not None:
        chosen = [t for t in tools.functions if tools.forced in (None, t.name)]
        one_call = tools.forced is not None or not tools.parallel
        marker_id = llm.tokenizer.token_to_id(MISTRAL_CALLS)
        grammar = forced_calls_grammar(fmt, chosen, one_call, marker_id)
        forced = StructuredOutput.lark(grammar, tools.choice_param)
    in_template = reads_tools(llm)
    return ToolPlan(
        template_tools=forms if in_template else None,
        system_prompt=None if in_template else fallback_prompt(forms),
        forced=forced,
        reader=ToolCallReader(fmt, names, tools.parallel, forced=forced is not None),
    )


def _checked(llm: ModelText, tool: FunctionTool, param: str) -> dict[str, Any]:
    """The tool as templates read it (OpenAI's shape); control-token text in it is refused."""
    form = tool.template_form()
    if llm.tokenizer.holds_special_text(json.dumps(form, ensure_ascii=False)):
        raise InvalidRequestError(f"{param} holds control-token text", param)
    return form


def fallback_prompt(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return FALLBACK_PROMPT.format(tools=lines)


def with_system_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """`prompt` at the head of the first system message (a new one when there is none)."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = prompt + ("\n\n" + first["content"] if first["content"] else "")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _call_schema(tool: FunctionTool, arguments_key: str) -> dict[str, Any]:
    parameters = tool.parameters or NO_ARGUMENTS
    if tool.strict is not False:
        parameters = closed_objects(parameters)
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def forced_calls_grammar(
    fmt: Format, tools: list[FunctionTool], one_call: bool, marker_id: int | None = None
) -> str:
    """A Lark grammar (llguidance's dialect, with `%json` for schemas) of one or more calls in
    `fmt`, each naming one of `tools` with arguments that follow its schema. `marker_id` is the
    id of Mistral's `[TOOL_CALLS]` special token."""
    key = "parameters" if fmt == "llama3_json" else "arguments"
    call = {"anyOf": [_call_schema(t, key) for t in tools], "x-guidance": _JSON_STYLE}
    if fmt == "mistral":
        calls = {"type": "array", "items": call, "minItems": 1, "x-guidance": _JSON_STYLE}
        if one_call:
            calls["maxItems"] = 1
        marker = f"<[{marker_id}]>" if marker_id is not None else f'"{MISTRAL_CALLS}"'
        return f"start: {marker} body\nbody: %json {json.dumps(calls)}"
    if fmt == "llama3_json":
        more = "" if one_call else ' ("; " call)*'
        return f"start: call{more}\ncall: %json {json.dumps(call)}"
    more = "" if one_call else ' ("\\n" call)*'
    return (
        f"start: call{more}\n"
        f'call: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\n'
        f"body: %json {json.dumps(call)}"
    )
