"""Settings: one typed, frozen object, and the only code that reads TOML files or `REBAR_*` env.

`load_settings(config_file, overrides)` layers, lowest to highest precedence:

1. the defaults declared on the models below;
2. the TOML file, if one is given (sections `[server]`, `[models]`, `[engine]`, `[limits]`,
   `[logging]`, `[tracing]`, ...);
3. `REBAR_<SECTION>__<KEY>` environment variables (case-insensitive; lists as JSON, e.g.
   `REBAR_SERVER__API_KEYS='["k1"]'`; a whole section as JSON in `REBAR_<SECTION>` also works;
   the process switches in `PROCESS_ENV_SWITCHES` are not settings and are skipped);
4. explicit overrides from the caller (the CLI), keyed `"section.key"`.

What callers may rely on: an unknown key in any layer and every invalid value raise
`rebar.errors.ConfigError` whose message names the dotted key (`server.port`), the bad value
(masked for secrets), where it came from and what is allowed. Optional settings are unset with
`""` or `"none"` (TOML has no null). Constructing `Settings(...)` directly reads no file and no
environment: it is defaults plus the given values, which keeps tests hermetic.
"""

from rebar.config.documents_settings import DocumentsSettings
from rebar.config.engine_settings import EngineSettings
from rebar.config.loading import check_engine_settings, load_settings, to_toml
from rebar.config.mcp_settings import McpServerSettings, McpSettings
from rebar.config.settings import (
    PROCESS_ENV_SWITCHES,
    CacheSettings,
    LimitsSettings,
    LoggingSettings,
    ModelsSettings,
    RateLimitSettings,
    RaySettings,
    ResponsesSettings,
    ServedModelSettings,
    ServerSettings,
    Settings,
    StoreSettings,
    TracingSettings,
    hash_api_key,
    read_api_key_file,
)

__all__ = [
    "PROCESS_ENV_SWITCHES",
    "CacheSettings",
    "DocumentsSettings",
    "EngineSettings",
    "LimitsSettings",
    "LoggingSettings",
    "McpServerSettings",
    "McpSettings",
    "ModelsSettings",
    "RateLimitSettings",
    "RaySettings",
    "ResponsesSettings",
    "ServedModelSettings",
    "ServerSettings",
    "Settings",
    "StoreSettings",
    "TracingSettings",
    "check_engine_settings",
    "hash_api_key",
    "load_settings",
    "read_api_key_file",
    "to_toml",
]
