"""The base of every request body rebar parses: unknown fields and wrong types are 400s, never
ignored, and text must be valid Unicode."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from rebar.errors import InvalidRequestError

INVALID_UNICODE = "invalid_unicode"


def lone_surrogate_path(
    value: Any, path: tuple[str | int, ...] = ()
) -> tuple[tuple[str | int, ...], str] | None:
    """(where, the character) of the first lone surrogate in a decoded JSON value, or None.

    JSON may spell a lone surrogate ("\\ud800"); Python decodes it to a str that no UTF-8 encoder,
    tokenizer or log line accepts, so it is refused at the edge.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, value[exc.start]
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        if isinstance(key, str) and (found := lone_surrogate_path(key, path)) is not None:
            return found
        if (found := lone_surrogate_path(item, (*path, key))) is not None:
            return found
    return None


class StrictBody(BaseModel):
    # extra="forbid": an OpenAI parameter rebar does not implement is refused, not silently dropped.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _proper_unicode(cls, data: Any) -> Any:
        found = lone_surrogate_path(data)
        if found is not None:
            where, char = found
            param = ".".join(str(part) for part in where) or "body"
            raise PydanticCustomError(
                INVALID_UNICODE,
                "{param}: text holds a lone surrogate (U+{code}); send valid Unicode",
                {"param": param, "code": f"{ord(char):04X}"},
            )
        return data


# Parts of a body read by hand (items and blocks whose shape depends on their `type`): each check
# names where in the body it failed.


def only_fields(item: dict[str, Any], allowed: set[str], where: str) -> None:
    """A 400 naming the first field of `item` (at `where`) that is not `allowed`."""
    extra = sorted(set(item) - allowed)
    if extra:
        raise InvalidRequestError(f"{where} has unsupported fields {extra}", f"{where}.{extra[0]}")


def text_field(value: Any, where: str) -> str:
    """`value` when it is a string; else a 400 naming `where`."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where} must be a string", where)
    return value
