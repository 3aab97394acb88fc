"""Command-line flags derived from setting definitions (rebar.engine.setting): one flag per setting.

`engine.block_size` becomes `--block-size N`, a boolean `--fused-decode / --no-fused-decode`, a
Literal setting a flag with those choices; the help text and default shown are the definition's.
A flag that is not given is absent from the parsed arguments, so it overrides nothing; an optional
setting given as "none" (or "") is explicitly unset. Types are parsed here, bounds are checked where
the values are used (EngineConfig, the settings loader), which raise rebar.errors.ConfigError.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Mapping
from typing import Any

from rebar.engine.engine_config import ENGINE_SETTINGS, EngineConfig
from rebar.engine.setting import SettingSpec


def add_engine_flags(parser: argparse.ArgumentParser, skip: Collection[str] = ()) -> None:
    """A flag for every engine setting except those named in `skip` (set by the command itself)."""
    group = parser.add_argument_group("engine settings")
    for spec in ENGINE_SETTINGS:
        if spec.name not in skip:
            _add_flag(group, spec)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, keyed "section.key"; None for one explicitly unset."""
    return {key: value for key, value in vars(args).items() if key in _FLAG_KEYS}


def engine_config_from_flags(args: argparse.Namespace, **fixed: Any) -> EngineConfig:
    """EngineConfig from the defaults, the engine flags given and the command's `fixed` values."""
    given = {key.removeprefix("engine."): value for key, value in given_settings(args).items()}
    return EngineConfig(**{**given, **fixed})


def as_overrides(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`given_settings` for `rebar.config.load_settings`, which reads "none" as unset."""
    return {key: "none" if value is None else value for key, value in settings.items()}


_FLAG_KEYS = frozenset(spec.key for spec in ENGINE_SETTINGS)


def _add_flag(group: Any, spec: SettingSpec) -> None:
    flag = "--" + spec.name.replace("_", "-")
    shown = "unset" if spec.default is None else spec.default
    help_text = f"{spec.help} Default: {shown}.".replace("%", "%%")
    common: dict[str, Any] = {"dest": spec.key, "default": argparse.SUPPRESS, "help": help_text}
    if spec.kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif spec.choices:
        group.add_argument(flag, choices=spec.choices, **common)
    else:
        group.add_argument(flag, type=_parser(spec), metavar=spec.name.upper(), **common)


def _parser(spec: SettingSpec) -> Callable[[str], Any]:
    value_type = spec.value_type

    def parse(text: str) -> Any:
        if spec.optional and text.strip().lower() in ("", "none"):
            return None
        return value_type(text)

    parse.__name__ = value_type.__name__  # argparse names it: "invalid int value: 'x'"
    return parse
