"""One setting's definition: its default, bounds and help text, and the check every value passes.

A frozen config dataclass declares each field with `setting(...)`; the field's annotation is the
type (`int`, `float`, `bool`, `str`, a `Literal` of allowed names, any of them `| None` when the
setting may be unset). `rebar.config` derives its settings sections and the command line its flags
from these definitions, so a default, a bound or a help text is written once. Pure Python: no
torch, no pydantic.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from rebar.errors import ConfigError

_KIND_NAMES = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}


def setting(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> Any:
    """A dataclass field holding a setting: its default, help text and bounds (inclusive ge/le)."""
    return dataclasses.field(default=default, metadata={"help": help, "ge": ge, "gt": gt, "le": le})


def same_setting(config_class: type, name: str) -> Any:
    """A dataclass field defined exactly as `config_class`'s field `name` (default, help,
    bounds)."""
    source = next(field for field in dataclasses.fields(config_class) if field.name == name)
    return dataclasses.field(default=source.default, metadata=source.metadata)


@dataclass(frozen=True)
class SettingSpec:
    """What one field accepts. `kind` is int, float, bool, str or a Literal of allowed names."""

    section: str
    name: str
    kind: Any
    optional: bool
    default: Any
    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def choices(self) -> tuple[str, ...]:
        """The allowed names of a Literal setting; empty for any other kind."""
        return get_args(self.kind) if get_origin(self.kind) is Literal else ()

    @property
    def value_type(self) -> type:
        """The Python type of a (set) value: str for a Literal setting."""
        return str if self.choices else self.kind

    def allowed(self) -> str:
        """Plain words for the accepted values, e.g. "an integer >= 1"."""
        if self.choices:
            text = "one of " + ", ".join(repr(choice) for choice in self.choices)
        else:
            text = _KIND_NAMES[self.kind] + self._bounds()
        return text + (" or None (unset)" if self.optional else "")

    def check(self, value: Any) -> None:
        """Raise ConfigError naming the key, the value and what is allowed unless `value` fits."""
        if not self._accepts(value):
            raise ConfigError(f"invalid setting {self.key} = {value!r}; allowed: {self.allowed()}")

    def _accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or self.kind is bool:  # True is an int to Python, not to us
            return isinstance(value, bool) and self.kind is bool
        if self.kind is str:
            return isinstance(value, str)
        if not isinstance(value, int | float) or (self.kind is int and not isinstance(value, int)):
            return False
        return self._within_bounds(value)

    def _within_bounds(self, number: float) -> bool:
        return (
            (self.ge is None or number >= self.ge)
            and (self.gt is None or number > self.gt)
            and (self.le is None or number <= self.le)
        )

    def _bounds(self) -> str:
        words = {">=": self.ge, ">": self.gt, "<=": self.le}
        parts = [f"{word} {bound}" for word, bound in words.items() if bound is not None]
        return (" " + " and ".join(parts)) if parts else ""


def setting_specs(config_class: type, section: str) -> tuple[SettingSpec, ...]:
    """The definitions of `config_class`'s setting fields, in declaration order."""
    hints = get_type_hints(config_class)
    specs = []
    for field in dataclasses.fields(config_class):
        if "help" not in field.metadata:
            continue
        kind, optional = _split_optional(hints[field.name])
        meta = field.metadata
        bounds = {"ge": meta["ge"], "gt": meta["gt"], "le": meta["le"]}
        specs.append(
            SettingSpec(section, field.name, kind, optional, field.default, meta["help"], **bounds)
        )
    return tuple(specs)


def check_settings(config: Any, section: str) -> None:
    """Check every setting field of the dataclass instance `config`; raises ConfigError."""
    for spec in setting_specs(type(config), section):
        spec.check(getattr(config, spec.name))


def _split_optional(hint: Any) -> tuple[Any, bool]:
    if get_origin(hint) in (Union, types.UnionType):
        members = [arg for arg in get_args(hint) if arg is not type(None)]
        assert len(members) == 1, f"a setting has one type or that type | None, not {hint}"
        return members[0], True
    return hint, False
