"""Command-line flags derived from the settings' definitions: one flag per setting, for every
command.

`engine.block_size` becomes `--block-size N`, a boolean `--fused-decode / --no-fused-decode`, a
Literal setting a flag with those choices; the help text and the default shown are the field's own
(its `description`). A flag that is not given is absent from the parsed arguments, so it overrides
nothing; an optional setting given as "none" (or "") is explicitly unset. Types are parsed here;
bounds are checked by `load_settings`, which names the setting and where its value came from.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from rebar.config.loading import load_settings
from rebar.config.settings import Settings


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML settings file (see rebar.toml); flags and REBAR_* variables override it",
    )


def add_setting_flags(
    parser: argparse.ArgumentParser,
    section: str,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
) -> None:
    """A flag for each setting of `section` (those in `only`, when given), except `skip`."""
    fields = _section_fields(section)
    group = parser.add_argument_group(f"[{section}] settings")
    for name, field in fields.items():
        if name not in skip and (only is None or name in only):
            _add_flag(group, f"{section}.{name}", field)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, keyed "section.key"; None for one explicitly unset."""
    return {key: value for key, value in vars(args).items() if key in _setting_keys()}


def as_overrides(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`given_settings` for `load_settings`, which reads "none" as unset."""
    return {key: "none" if value is None else value for key, value in settings.items()}


def settings_from_flags(args: argparse.Namespace, **fixed: Any) -> Settings:
    """Defaults < `--config` file < `REBAR_*` variables < the setting flags given < `fixed` (dotted
    keys the command sets itself, e.g. `engine.max_num_seqs` from `--concurrency`)."""
    overrides = {**as_overrides(given_settings(args)), **fixed}
    return load_settings(getattr(args, "config", None), overrides, "from the command line")


def _section_fields(section: str) -> dict[str, FieldInfo]:
    model = Settings.model_fields[section].annotation
    assert isinstance(model, type), section
    return dict(model.model_fields)


def _setting_keys() -> frozenset[str]:
    return frozenset(
        f"{section}.{name}"
        for section in Settings.model_fields
        for name in _section_fields(section)
    )


def _add_flag(group: Any, key: str, field: FieldInfo) -> None:
    name = key.split(".", 1)[1]
    flag = "--" + name.replace("_", "-")
    kind, optional = _plain_type(field.annotation)
    shown = "unset" if field.default is None else field.default
    help_text = f"{field.description or ''} Default: {shown}.".strip().replace("%", "%%")
    common: dict[str, Any] = {"dest": key, "default": argparse.SUPPRESS, "help": help_text}
    if kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif get_origin(kind) is Literal:
        group.add_argument(flag, choices=get_args(kind), **common)
    else:
        group.add_argument(flag, type=_parser(kind, optional), metavar=name.upper(), **common)


def _plain_type(annotation: Any) -> tuple[Any, bool]:
    """(the value's type without Annotated or None, whether None is allowed)."""
    optional = False
    if get_origin(annotation) in (Union, types.UnionType):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        optional = len(members) < len(get_args(annotation))
        assert len(members) == 1, f"a setting has one type or that type | None, not {annotation}"
        annotation = members[0]
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation, optional


def _parser(kind: type, optional: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if optional and text.strip().lower() in ("", "none"):
            return None
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names it: "invalid int value: 'x'"
    return parse
