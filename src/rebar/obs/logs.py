"""Logs: one JSON object per line, each tagged with the request and the trace it belongs to.

`bind_request_id` (called by the request-id middleware) puts the id in a context variable; the
current OpenTelemetry span gives the trace id. Every record logged while a request is handled —
by rebar, uvicorn or a library — carries both. Structured fields go in `extra={"fields": {...}}`.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar, Token
from datetime import UTC, datetime

from rebar.obs.tracing import current_trace_id

_request_id: ContextVar[str | None] = ContextVar("rebar_request_id", default=None)

# Attributes every LogRecord has; anything else set through `extra=` is a field of ours.
# uvicorn's `color_message` is its terminal rendering of the message: noise in a JSON line.
_STANDARD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",
}


def bind_request_id(request_id: str) -> Token:
    return _request_id.set(request_id)


def unbind_request_id(token: Token) -> None:
    _request_id.reset(token)


class RequestContextFilter(logging.Filter):
    """Adds `request_id` and `trace_id` to every record (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _request_id.get()
        if not hasattr(record, "trace_id"):
            record.trace_id = current_trace_id()
        return True


def _fields(record: logging.LogRecord) -> dict:
    fields = dict(getattr(record, "fields", None) or {})
    for key, value in vars(record).items():
        if key not in _STANDARD_ATTRIBUTES and key not in ("fields", "request_id", "trace_id"):
            fields.setdefault(key, value)
    return fields


class JsonFormatter(logging.Formatter):
    """time (UTC, ISO 8601 with milliseconds), level, logger, message, request_id, trace_id, then
    fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
            "trace_id": getattr(record, "trace_id", None),
        }
        for key, value in _fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """For a terminal: `time level logger: message key=value ...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {"request_id": getattr(record, "request_id", None), **_fields(record)}
        extra = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        return f"{line} {extra}" if extra else line


def configure_logging(level: str = "info", fmt: str = "json", stream=None) -> logging.Handler:
    """One handler on the root logger for every library's records; uvicorn's access log is replaced
    by ours."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # libraries: warnings and up
    logging.getLogger("rebar").setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
        uvicorn_logger.setLevel(level.upper())
    logging.getLogger(
        "uvicorn.access"
    ).disabled = True  # `rebar.access` logs each request with more fields
    return handler
