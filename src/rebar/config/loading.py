"""Reading the settings' layers: defaults < TOML file < `REBAR_*` environment < overrides.

Every unknown key and invalid value becomes a ConfigError naming the dotted key, the (masked) value,
the layer it came from and what is allowed.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource, SettingsError

from rebar.config.base import blank_to_none
from rebar.config.engine_settings import PROCESS_FIELDS, EngineSettings
from rebar.config.settings import (
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    PROCESS_ENV_SWITCHES,
    SECRET_KEYS,
    Settings,
)
from rebar.errors import ConfigError


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    overrides_origin: str = "from overrides",
) -> Settings:
    """Defaults < `config_file` (TOML) < `REBAR_*` env < `overrides` (`{"server.port": 9000}`).

    An override whose value is None is skipped, so CLI flags that were not given can be passed
    as they are; to unset an optional setting pass "" or "none". Raises ConfigError.
    """
    file_layer = _read_toml(Path(config_file)) if config_file is not None else {}
    env_layer = _read_env()
    override_layer = _nest_overrides(overrides or {})
    merged = _deep_merge(_deep_merge(file_layer, env_layer), override_layer)
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        origins = _Origins(config_file, file_layer, env_layer, override_layer, overrides_origin)
        lines = dict.fromkeys(
            _describe_error(error, origins) for error in exc.errors(include_url=False)
        )
        raise ConfigError("\n".join(lines)) from None


def check_engine_settings(values: Mapping[str, Any], origin: str) -> EngineSettings:
    """`[engine]` settings given as Python values (`LLM(block_size=8)`), checked strictly (no
    strings for numbers) against their definition. Process settings (`num_threads`,
    `separate_process`) are refused: they belong to whoever runs the engine. Raises ConfigError
    naming each bad setting, its value, `origin` and what is allowed."""
    known = [name for name in EngineSettings.model_fields if name not in PROCESS_FIELDS]
    for name in values:
        if name not in known:
            raise _unknown(f"engine.{name}", [f"engine.{k}" for k in known], origin)
    try:
        return EngineSettings.model_validate(dict(values), strict=True)
    except ValidationError as exc:
        lines = []
        for error in exc.errors(include_url=False):
            name = str(error["loc"][0])
            field = EngineSettings.model_fields[name]
            message = error["msg"].removeprefix("Value error, ")
            lines.append(
                f"invalid setting engine.{name} = {values[name]!r} {origin}: {message}; "
                f"allowed: {describe_allowed(field)}"
            )
        raise ConfigError("\n".join(dict.fromkeys(lines))) from None


def to_toml(data: Mapping[str, Mapping[str, Any]]) -> str:
    """`masked_dict()`-shaped data as TOML text that loads back to the same settings (None
    as "")."""
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(
                f'{key} = ""  # unset' if value is None else f"{key} = {_toml_value(value)}"
            )
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):  # an inline table; its None values are simply left out
        items = (
            f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items() if v is not None
        )
        return "{ " + ", ".join(items) + " }" if value else "{}"
    return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a valid TOML basic string


# --- layers -------------------------------------------------------------------------------


def _sections() -> dict[str, type[BaseModel]]:
    return {name: field.annotation for name, field in Settings.model_fields.items()}  # type: ignore[misc]


def _unknown(dotted: str, known: list[str], where: str) -> ConfigError:
    suggestion = difflib.get_close_matches(dotted, known, n=1)
    hint = f"; did you mean {suggestion[0]!r}?" if suggestion else ""
    return ConfigError(f"unknown setting {dotted!r} {where}{hint} (known: {', '.join(known)})")


def _check_known(path: tuple[str, ...], where: str) -> None:
    """Raise unless `path` names a section or a section's field."""
    sections = _sections()
    if path[0] not in sections:
        raise _unknown(".".join(path), list(sections), where)
    fields = list(sections[path[0]].model_fields)
    if len(path) > 1 and path[1] not in fields:
        raise _unknown(".".join(path), [f"{path[0]}.{name}" for name in fields], where)
    if len(path) > 2:
        raise ConfigError(
            f"unknown setting {'.'.join(path)!r} {where}: {'.'.join(path[:2])} has no sub-keys"
        )


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot parse config file {str(path)!r}: {exc}") from None
    where = f"in {str(path)!r}"
    for section, values in data.items():
        _check_known((section,), where)
        if isinstance(values, dict):
            for key in values:
                _check_known((section, key), where)
    server = data.get("server")
    if (
        isinstance(server, dict)
        and isinstance(server.get("api_key_file"), str)
        and blank_to_none(server["api_key_file"])
    ):
        server["api_key_file"] = str(
            path.parent / Path(server["api_key_file"]).expanduser()
        )  # absolute stays absolute
    return data


def _read_env() -> dict[str, Any]:
    for name, raw in os.environ.items():
        if not name.upper().startswith(ENV_PREFIX) or name.upper() in PROCESS_ENV_SWITCHES:
            continue
        path = tuple(name[len(ENV_PREFIX) :].lower().split(ENV_NESTED_DELIMITER))
        _check_known(path, f"from environment variable {name}")
        field = _field(path)
        if field is None or get_origin(field.annotation) is tuple:
            expected = "a JSON object" if field is None else 'a JSON list, e.g. ["a", "b"]'
            try:
                json.loads(raw)
            except json.JSONDecodeError as exc:
                # the message never echoes the value: it may be a key
                raise ConfigError(
                    f"environment variable {name} is not valid JSON "
                    f"({exc.msg}); {'.'.join(path)} expects {expected}"
                ) from None
    try:
        return EnvSettingsSource(Settings)()
    except SettingsError as exc:
        raise ConfigError(
            f"cannot parse a {ENV_PREFIX}* environment "
            f"variable: {exc} (lists and sections are JSON)"
        ) from None


def _nest_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for dotted, value in overrides.items():
        path = tuple(dotted.split("."))
        if len(path) != 2:
            raise ConfigError(f"unknown setting {dotted!r} in overrides: expected 'section.key'")
        _check_known(path, "in overrides")
        if value is not None:
            nested.setdefault(path[0], {})[path[1]] = value
    return nested


def _deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# --- error messages -----------------------------------------------------------------------


class _Origins:
    """Says which layer supplied the value at a path, for error messages."""

    def __init__(
        self,
        config_file: Path | None,
        file_layer: dict,
        env_layer: dict,
        override_layer: dict,
        overrides_origin: str,
    ) -> None:
        self.config_file, self.file_layer, self.env_layer = config_file, file_layer, env_layer
        self.override_layer, self.overrides_origin = override_layer, overrides_origin

    def describe(self, path: tuple[str, ...]) -> str:
        if _has_path(self.override_layer, path):
            return self.overrides_origin
        if _has_path(self.env_layer, path):
            upper = {name.upper(): name for name in os.environ}
            for depth in range(len(path), 0, -1):
                name = (ENV_PREFIX + ENV_NESTED_DELIMITER.join(path[:depth])).upper()
                if name in upper:
                    return f"from environment variable {upper[name]}"
            return "from the environment"
        if _has_path(self.file_layer, path):
            return f"in {str(self.config_file)!r}"
        return "by default"


def _has_path(data: Any, path: tuple[str, ...]) -> bool:
    for part in path:
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


def _describe_error(error: Any, origins: _Origins) -> str:
    loc = tuple(str(part) for part in error["loc"])
    path = loc[:2]
    dotted = ".".join(path)
    origin = origins.describe(path)
    if len(loc) > 2 and loc[2].isdigit():  # inside one entry of a list of tables (models.serve)
        where = f"{dotted}[{loc[2]}]" + "".join(f".{part}" for part in loc[3:])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            return f"unknown setting {where!r} {origin}"
        return f"invalid setting {where} = {error['input']!r} {origin}: {message}"
    if error["type"] == "extra_forbidden":
        return f"unknown setting {'.'.join(loc)!r} {origin}"
    field = _field(path)
    if field is None:  # a whole section is wrong, or a check across its fields failed
        message = error["msg"].removeprefix("Value error, ")
        return f"invalid setting {dotted} {origin}: {message}"
    value = "***" if dotted in SECRET_KEYS else repr(error["input"])
    message = error["msg"].removeprefix("Value error, ")
    return (
        f"invalid setting {dotted} = {value} {origin}: "
        f"{message}; allowed: {describe_allowed(field)}"
    )


def _field(path: tuple[str, ...]) -> FieldInfo | None:
    if len(path) != 2:
        return None
    section = _sections().get(path[0])
    return section.model_fields.get(path[1]) if section is not None else None


_TYPE_NAMES: dict[Any, str] = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    Path: "a file path",
}


def describe_allowed(field: FieldInfo) -> str:
    """Plain words for the values `field` accepts, e.g. "an integer from 1 to 65535"."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "allowed" in extra:
        return str(extra["allowed"])
    annotation, constraints = field.annotation, list(field.metadata)
    optional = False
    if get_origin(annotation) in (Union, type(int | None)):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        optional = len(members) < len(get_args(annotation))
        annotation = members[0]
    # Annotated[int, Field(ge=2)] | None keeps its bounds inside.
    if get_origin(annotation) is Annotated:
        annotation, *inner = get_args(annotation)
        constraints += [
            item
            for meta in inner
            for item in (meta.metadata if isinstance(meta, FieldInfo) else [meta])
        ]
    if get_origin(annotation) is Literal:
        text = "one of " + ", ".join(repr(choice) for choice in get_args(annotation))
    elif get_origin(annotation) is tuple:
        text = "a list of strings"
    elif annotation is str and any(getattr(item, "min_length", 0) for item in constraints):
        text = "a non-empty string"
    else:
        text = _TYPE_NAMES.get(annotation, str(annotation)) + _bounds(constraints)
    return text + (' or "" / "none" to unset' if optional else "")


def _bounds(constraints: list[Any]) -> str:
    found = {
        name: getattr(item, name)
        for item in constraints
        for name in ("ge", "gt", "le", "lt")
        if getattr(item, name, None) is not None
    }
    if "ge" in found and "le" in found:
        return f" from {found['ge']} to {found['le']}"
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{words[name]} {value}" for name, value in found.items() if name in words]
    return (" " + " and ".join(parts)) if parts else ""
