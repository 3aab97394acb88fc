"""Log records as JSON lines: standard fields, request and trace ids from the context, extra fields,
exceptions."""

from __future__ import annotations

import io
import json
import logging

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rebar.obs.logs import (
    JsonFormatter,
    RequestContextFilter,
    TextFormatter,
    bind_request_id,
    configure_logging,
    unbind_request_id,
)
from rebar.obs.tracing import Tracing


def capture(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(formatter)
    handler.addFilter(RequestContextFilter())
    logger = logging.getLogger(f"rebar.test.{id(buffer)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, buffer


def lines(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_json_line_carries_request_and_trace_ids_and_fields() -> None:
    logger, buffer = capture(JsonFormatter())
    tracing = Tracing(span_exporter=InMemorySpanExporter())
    logger.info("outside")
    token = bind_request_id("req-42")
    try:
        with tracing.tracer.start_as_current_span("work") as span:
            logger.warning(
                "inside %s", "a request", extra={"fields": {"route": "/v1/x", "status": 200}}
            )
            trace_id = format(span.get_span_context().trace_id, "032x")
    finally:
        unbind_request_id(token)
    outside, inside = lines(buffer)
    assert (
        outside["request_id"] is None and outside["trace_id"] is None and outside["level"] == "info"
    )
    assert inside["message"] == "inside a request" and inside["level"] == "warning"
    assert inside["request_id"] == "req-42" and inside["trace_id"] == trace_id
    assert inside["route"] == "/v1/x" and inside["status"] == 200
    assert inside["time"].endswith("+00:00") and "T" in inside["time"]
    assert list(inside)[:6] == ["time", "level", "logger", "message", "request_id", "trace_id"]


def test_exceptions_and_odd_values_stay_one_json_line() -> None:
    logger, buffer = capture(JsonFormatter())
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logger.exception("failed", extra={"fields": {"path": object()}})
    (entry,) = lines(buffer)  # one line: newlines are escaped inside the JSON string
    assert "ValueError: boom" in entry["exception"] and entry["path"].startswith("<object")


def test_text_format_for_terminals() -> None:
    logger, buffer = capture(TextFormatter())
    token = bind_request_id("req-7")
    try:
        logger.info("hello", extra={"fields": {"status": 201}})
    finally:
        unbind_request_id(token)
    line = buffer.getvalue().strip()
    assert line.endswith("hello request_id=req-7 status=201") and " INFO " in line


def test_configure_logging_routes_library_records_through_one_json_handler() -> None:
    root = logging.getLogger()
    saved = (
        list(root.handlers),
        root.level,
        logging.getLogger("rebar").level,
        logging.getLogger("uvicorn.access").disabled,
    )
    buffer = io.StringIO()
    try:
        configure_logging("debug", "json", stream=buffer)
        logging.getLogger("rebar.engine").debug("engine detail")
        logging.getLogger("uvicorn.error").info("Started server process")
        logging.getLogger("some.library").info("chatter")  # below the libraries' warning level
        logging.getLogger("uvicorn.access").info("GET / 200")  # replaced by rebar.access
        entries = lines(buffer)
        assert [e["logger"] for e in entries] == ["rebar.engine", "uvicorn.error"]
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("rebar").setLevel(saved[2])
        logging.getLogger("uvicorn.access").disabled = saved[3]
