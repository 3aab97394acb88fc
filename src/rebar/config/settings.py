"""The settings schema: one frozen pydantic model per section, and `Settings`, which holds them.

The `[engine]` section is in `rebar.config.engine_settings`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from rebar.config.base import Section, Unsettable
from rebar.config.documents_settings import DocumentsSettings
from rebar.config.engine_settings import EngineSettings
from rebar.config.mcp_settings import McpSettings
from rebar.dtypes import DtypeName
from rebar.errors import ConfigError

ENV_PREFIX = "REBAR_"
ENV_NESTED_DELIMITER = "__"
SECRET_KEYS = frozenset({"server.api_keys", "server.admin_api_keys"})
# Process-wide switches read where they act, not settings; the settings loader skips them.
# REBAR_DISABLE_CPU_KERNELS=1: never build or use rebar.kernels.cpu_quant; REBAR_CPU_ISA: build
# those kernels for a narrower instruction set; REBAR_LLAMA_CPP_BIN: where `rebar bench compare`
# finds llama.cpp's tools.
PROCESS_ENV_SWITCHES = frozenset(
    {"REBAR_DISABLE_CPU_KERNELS", "REBAR_CPU_ISA", "REBAR_LLAMA_CPP_BIN"}
)


def hash_api_key(key: str) -> str:
    """SHA-256 hex digest of an API key; the only form in which the server keeps keys."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _check_api_key(key: str) -> None:
    if not key or any(char.isspace() for char in key):
        raise ValueError("an API key must be non-empty and contain no whitespace")


class ServerSettings(Section):
    """HTTP listener, authentication and request-size limits. An empty key set means auth is off."""

    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8000, ge=1, le=65535)
    api_keys: tuple[SecretStr, ...] = ()
    # One key per line; blank lines and lines starting with "#" are ignored. A relative path in a
    # TOML file is relative to that file's folder.
    api_key_file: Annotated[Path | None, Unsettable] = None
    max_body_bytes: int = Field(2**20, ge=1024)
    # A connection that has not sent its request headers (or a request its body) within these is
    # closed with 408: half-sent requests cannot hold connections open.
    header_timeout_s: float = Field(15.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    # Open connections beyond this get 503 at once; the process file limit is raised to fit it.
    max_connections: int = Field(1024, ge=1)
    # Addresses of reverse proxies whose X-Forwarded-For / X-Forwarded-Proto are believed ("*":
    # any). Empty: the socket's peer address is the client, whatever the headers say.
    trusted_proxies: tuple[str, ...] = ()
    drain_timeout_s: float = Field(30.0, ge=0)
    cors_allow_origins: tuple[str, ...] = ()
    # Keys for /admin/* (profiling). None configured: the admin endpoints answer 403.
    admin_api_keys: tuple[SecretStr, ...] = ()

    @field_validator("api_key_file")
    @classmethod
    def _expand_user(cls, path: Path | None) -> Path | None:
        return path.expanduser() if path is not None else None

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _keys_are_tokens(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        for key in keys:
            _check_api_key(key.get_secret_value())
        return keys


def served_name(model: str) -> str:
    """The id clients use for a model given by alias or path: the alias, or the file/folder
    name."""
    return (
        Path(model).name.removesuffix(".gguf")
        if ("/" in model or model.endswith(".gguf"))
        else model
    )


class ServedModelSettings(Section):
    """One `[[models.serve]]` entry: a model the service may serve, loaded at start when pinned,
    else on its first request, and unloaded after `keep_alive_s` idle or to make room."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")  # the API's `model` id
    model: str = Field(min_length=1)  # an alias, a .gguf file or an HF folder
    kind: Literal["chat", "embedding"] = "chat"
    # Bytes for weights + KV cache; the KV cache gets what the weights leave. None: weights plus
    # the KV cache [engine] sizes.
    memory_budget: Annotated[Annotated[int, Field(ge=2**20)] | None, Unsettable] = None
    keep_alive_s: float = Field(300.0, ge=0)  # idle seconds before it is unloaded
    pinned: bool = False  # loaded at start and never unloaded


class ModelsSettings(Section):
    """Which models to serve. `chat` and `embedding` are a shorthand for one pinned entry each
    (None disables it); `serve` lists more."""

    chat: Annotated[str | None, Unsettable] = "smollm2"
    embedding: Annotated[str | None, Unsettable] = "minilm"
    serve: tuple[ServedModelSettings, ...] = ()
    # Bytes all loaded models may hold together; idle unpinned ones are unloaded (least recently
    # used first) to make room. None: 90% of the memory available when the server starts.
    memory_budget: Annotated[Annotated[int, Field(ge=2**20)] | None, Unsettable] = None
    # Seconds a request waits for its model to load before a 503 with Retry-After.
    load_wait_s: float = Field(60.0, gt=0)
    dtype: DtypeName = "float32"
    # Expand quantized (GGUF) weights to `dtype` at load: the float reference, several times slower
    # and larger. Off: they stay quantized and run on rebar's kernels (activations rounded to int8,
    # as llama.cpp does).
    dequantize: bool = False
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
        json_schema_extra={"allowed": "auto, cpu, mps, cuda or cuda:N"},
    )

    @model_validator(mode="after")
    def _serves_something(self) -> ModelsSettings:
        entries = self.entries()
        if not entries:
            raise ValueError(
                "models.chat, models.embedding and models.serve are all empty; nothing to serve"
            )
        names = [entry.name for entry in entries]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"two served models are named {', '.join(map(repr, repeated))}")
        return self

    def shorthand(self) -> tuple[ServedModelSettings, ...]:
        """The pinned entries `chat` and `embedding` stand for (those set)."""
        return tuple(
            ServedModelSettings(name=served_name(model), model=model, kind=kind, pinned=True)
            for model, kind in ((self.chat, "chat"), (self.embedding, "embedding"))
            if model is not None
        )

    def entries(self) -> tuple[ServedModelSettings, ...]:
        """Every model the service may serve: the shorthand entries, then `serve`."""
        return self.shorthand() + self.serve


class LimitsSettings(Section):
    """Admission control: beyond these queue limits requests get 503 with Retry-After."""

    max_waiting_requests: int = Field(256, ge=1)
    max_waiting_prompt_tokens: int = Field(262144, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)
    retry_after_s: int = Field(1, ge=0)
    max_waiting_embedding_inputs: int = Field(4096, ge=1)


class StoreSettings(Section):
    """Where caches and rate-limit counters live: in-process ("memory") or a shared Redis."""

    backend: Literal["memory", "redis"] = "memory"
    url: str = "redis://127.0.0.1:6379/0"  # used when backend = "redis"
    key_prefix: str = Field("rebar", min_length=1)
    call_timeout_s: float = Field(0.25, gt=0)
    failure_threshold: int = Field(3, ge=1)  # consecutive failures that open the circuit
    open_for_s: float = Field(5.0, gt=0)  # how long the circuit stays open before a trial call
    on_store_error: Literal["allow", "deny"] = "allow"  # rate limiting while the store is down
    # The in-process store's budget (caches, locks, counters); past either the oldest writes go
    # first. Redis has its own (maxmemory with an eviction policy).
    memory_max_entries: int = Field(100_000, ge=1)
    memory_max_bytes: int = Field(256 * 2**20, ge=2**16)


class CacheSettings(Section):
    """Response cache (deterministic requests only) and embedding cache."""

    enabled: bool = True
    ttl_s: float = Field(3600.0, gt=0)  # how long a cached completion is fresh
    stale_s: float = Field(60.0, ge=0)  # after that, served stale while one request refreshes it
    lock_timeout_s: float = Field(30.0, gt=0)  # identical requests wait this long for the first one
    embedding_ttl_s: float = Field(86400.0, gt=0)
    # Keep each client's cached answers, embeddings and prefix-cache blocks to itself, so no client
    # can learn what another sent from a cache hit or `cached_tokens`. A client is its API key
    # (its address when keys are off). "auto": on when API keys are on.
    tenant_isolation: Literal["auto", "on", "off"] = "auto"
    # A bigger answer (many choices with logprobs, say) is served but not stored.
    max_entry_bytes: int = Field(4 * 2**20, ge=1024)


class RateLimitEntry(Section):
    requests_per_minute: Annotated[Annotated[int, Field(ge=1)] | None, Unsettable] = None
    tokens_per_minute: Annotated[Annotated[int, Field(ge=1)] | None, Unsettable] = None


class RateLimitSettings(RateLimitEntry):
    """Per API key (per client address when keys are off). None = unlimited.

    `per_key` maps the SHA-256 hex digest of an API key to its own limits, so no key is written in
    the file: `python -c "import hashlib; print(hashlib.sha256(b'KEY').hexdigest())"`.
    """

    per_key: dict[str, RateLimitEntry] = Field(default_factory=dict)


class LoggingSettings(Section):
    """Log verbosity (case-insensitive) and shape: one JSON object per line, or plain text for a
    terminal."""

    level: Annotated[
        Literal["debug", "info", "warning", "error"],
        BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v),
    ] = "info"
    format: Literal["json", "text"] = "json"
    # Prompts and completions are user data: only in the access log when this is turned on.
    log_prompts: bool = False


class TracingSettings(Section):
    """OpenTelemetry traces. With exporter "none" spans still get ids (logs, X-Trace-ID) but go
    nowhere."""

    exporter: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str = Field(
        "http://127.0.0.1:4318/v1/traces", min_length=1
    )  # OTLP/HTTP (protobuf)
    service_name: str = Field("rebar", min_length=1)
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0
    )  # of new traces; an incoming traceparent's decision is kept


class ResponsesSettings(Section):
    """The Responses API's stored responses (`store: true`, its default) and background runs."""

    # Seconds a stored response stays retrievable (and continuable by previous_response_id).
    store_ttl_s: float = Field(30 * 24 * 3600.0, gt=0)
    # Largest stored record (the response, its input and the conversation before it), in bytes;
    # a bigger one is answered but not stored.
    max_stored_bytes: int = Field(4 * 2**20, ge=1024)
    # Seconds a cancel waits for the replica running a background response to confirm it.
    cancel_wait_s: float = Field(5.0, gt=0)


class RaySettings(Section):
    """`rebar serve --ray`: rebar's app as a Ray Serve deployment, N replicas behind Ray Serve's
    HTTP proxy (on `server.host`:`server.port`), each with its own engines."""

    # The Ray cluster: None starts one in this process's machine; "auto" joins the running one.
    address: Annotated[str | None, Unsettable] = None
    num_replicas: int = Field(1, ge=1)  # without autoscaling
    autoscaling: bool = False
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    # Ongoing requests per replica the autoscaler aims at (Ray Serve's target_ongoing_requests).
    target_ongoing_requests: float = Field(16.0, gt=0)
    # Requests a replica takes at once; more wait in Ray Serve's queue (Ray's own default, 5, would
    # starve continuous batching).
    max_ongoing_requests: int = Field(64, ge=1)
    num_cpus: float = Field(1.0, ge=0)  # CPUs Ray reserves per replica
    health_check_period_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> RaySettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError("ray.min_replicas is above ray.max_replicas")
        return self


class Settings(BaseSettings):
    """Every setting of a rebar process, grouped by section; frozen once built.

    Build it with `load_settings` (file + env + overrides) or `Settings(section={...})` (no env).
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        case_sensitive=False,
        extra="forbid",
        frozen=True,
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    models: ModelsSettings = Field(default_factory=ModelsSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    rate_limits: RateLimitSettings = Field(default_factory=RateLimitSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    mcp: McpSettings = Field(default_factory=McpSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    documents: DocumentsSettings = Field(default_factory=DocumentsSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # the environment is read only by load_settings, strictly

    def masked_dict(self) -> dict[str, dict[str, Any]]:
        """The effective settings as JSON-compatible data; each API key appears as "***"."""
        data = self.model_dump(mode="json")
        data["server"]["api_keys"] = ["***"] * len(self.server.api_keys)
        return data

    def api_key_hashes(self) -> frozenset[str]:
        """SHA-256 hex digests of `server.api_keys` plus the keys in `server.api_key_file` (read
        now).

        Empty means authentication is off. An unreadable or keyless key file raises ConfigError.
        """
        keys = [key.get_secret_value() for key in self.server.api_keys]
        if self.server.api_key_file is not None:
            keys.extend(read_api_key_file(self.server.api_key_file))
        return frozenset(hash_api_key(key) for key in keys)

    def admin_key_hashes(self) -> frozenset[str]:
        """SHA-256 hex digests of `server.admin_api_keys`; empty means the admin endpoints are
        closed."""
        return frozenset(hash_api_key(key.get_secret_value()) for key in self.server.admin_api_keys)


def read_api_key_file(path: Path) -> list[str]:
    """The keys in `path`, one per line; blank lines and `#` comment lines are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot read server.api_key_file {str(path)!r}: {reason}") from None
    keys = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if any(char.isspace() for char in key):
            raise ConfigError(
                f"server.api_key_file {str(path)!r} line "
                f"{line_number}: a key must not contain whitespace"
            )
        keys.append(key)
    if not keys:
        raise ConfigError(
            f"server.api_key_file {str(path)!r} holds no keys (auth would silently be off)"
        )
    return keys
