"""Checked reads of the values a checkpoint describes itself with, shared by GGUF metadata and HF
config.json so that a value is judged the same way whichever file it comes from.

A dimension is an integer (a float holding one is accepted: some converters write them), positive
and within `DIMENSION_LIMITS`; a scale (epsilon, RoPE base, factor) is a finite positive number;
lists hold what they should. Every failure is a ModelFormatError naming the key and its value, so
`rebar serve bad.gguf` says what is wrong instead of dividing by zero three modules later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from rebar.errors import ModelFormatError
from rebar.model.config import (
    DIMENSION_LIMITS,
    InvalidModelConfig,
    ModelConfig,
    dimension_problem,
    number_problem,
)

_MISSING: Any = object()
TOKEN_ID_LIMIT = DIMENSION_LIMITS["vocab_size"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_flag(value: object) -> bool:
    return isinstance(value, (bool, int))


def _whole(value: Any) -> Any:
    """`value`, as an int when it is a float holding a whole number (64.0 -> 64)."""
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return value


class ConfigValues:
    """A checkpoint's key -> value settings, read with checks.

    `source` opens every message ("GGUF metadata", the path of a config.json). A key whose value is
    absent or null takes the caller's default; without one it is a missing required key. `keys`
    records which key each ModelConfig field was read from, so that `model_config` can name the keys
    behind a combination of fields that cannot go together.
    """

    def __init__(self, values: Mapping[str, Any], source: str) -> None:
        self._values = values
        self.source = source
        self.keys: dict[str, str] = {}

    def has(self, key: str) -> bool:
        return self._values.get(key) is not None

    def names(self) -> list[str]:
        return list(self._values)

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        value = self._values.get(key)
        if value is not None:
            return value
        if default is _MISSING:
            raise ModelFormatError(f"{self.source} is missing required key {key!r}")
        return default

    def error(self, key: str, value: object, problem: str) -> ModelFormatError:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else f"{shown[:77]}..."  # a whole vocabulary is no help
        return ModelFormatError(f"{self.source} {key!r} is {shown}; it {problem}")

    def integer(self, key: str, default: Any = _MISSING, *, low: int = 0, high: int = 2**31) -> int:
        value = _whole(self.raw(key, default))
        if not _is_int(value) or not low <= value <= high:
            raise self.error(key, value, f"must be an integer from {low} to {high}")
        return value

    def dimension(self, key: str, field: str, default: Any = _MISSING) -> int:
        """Dimension `field` of the ModelConfig (a key of DIMENSION_LIMITS), read from `key`."""
        value = _whole(self.raw(key, default))
        problem = dimension_problem(value, field)
        if problem is not None:
            raise self.error(key, value, problem)
        self.keys.setdefault(field, key)
        return value

    def number(self, key: str, default: Any = _MISSING) -> float:
        """A finite positive number (epsilon, RoPE base, factor)."""
        value = self.raw(key, default)
        problem = number_problem(value)
        if problem is not None:
            raise self.error(key, value, problem)
        return float(value)

    def string(self, key: str, default: Any = _MISSING) -> str:
        if default is not _MISSING and not self.has(key):
            return default  # unchecked: callers pass None to learn that the key is absent
        value = self.raw(key)
        if not isinstance(value, str):
            raise self.error(key, value, "must be a string")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if value not in (True, False):  # also admits 0 and 1, as some writers store flags
            raise self.error(key, value, "must be true or false")
        return bool(value)

    def section(self, key: str) -> ConfigValues:
        """The object under `key` (empty when absent), read with the same checks."""
        value = self.raw(key, {})
        if not isinstance(value, Mapping):
            raise self.error(key, value, "must be an object")
        return ConfigValues(value, f"{self.source} {key!r}")

    def list_of(self, key: str, kind: str, default: Any = _MISSING) -> list[Any]:
        """A list whose items are all `kind`: "strings", "integers", "numbers" or "flags" (booleans
        or integers)."""
        if default is not _MISSING and not self.has(key):
            return default
        value = self.raw(key)
        is_item = _ITEM_CHECKS[kind]
        if not isinstance(value, list) or not all(map(is_item, value)):
            raise self.error(key, value, f"must be a list of {kind}")
        return value

    def token_id(self, key: str, vocab_size: int = TOKEN_ID_LIMIT) -> int | None:
        """An optional token id, which must name a token of the vocabulary."""
        if not self.has(key):
            return None
        return self.integer(key, low=0, high=vocab_size - 1)

    def head_dim(self, key: str, hidden: int, num_heads: int) -> int:
        """The head size `key` gives, or hidden / heads when the file gives none (which must then
        divide)."""
        if self.has(key):
            return self.dimension(key, "head_dim")
        hidden_key, heads_key = (
            self.keys.get("hidden_size", "hidden size"),
            self.keys.get("num_heads", "heads"),
        )
        if hidden % num_heads:
            raise ModelFormatError(
                f"{self.source} gives no {key!r}, and {hidden_key!r} = {hidden} is not a multiple "
                f"of {heads_key!r} = {num_heads}, so the heads have no size"
            )
        self.keys["head_dim"] = f"{hidden_key} / {heads_key}"
        return hidden // num_heads

    def model_config(self, **fields: Any) -> ModelConfig:
        """A ModelConfig of `fields`; fields that cannot go together are named by the keys they came
        from."""
        try:
            return ModelConfig(**fields)
        except InvalidModelConfig as exc:
            culprits = ", ".join(
                f"{name} from {self.keys[name]!r}" for name in exc.fields if name in self.keys
            )
            raise ModelFormatError(
                f"{self.source} describes an impossible model: {exc}"
                + (f" ({culprits})" if culprits else "")
            ) from exc


_ITEM_CHECKS: dict[str, Callable[[object], bool]] = {
    "strings": _is_str,
    "integers": _is_int,
    "numbers": _is_number,
    "flags": _is_flag,
}
