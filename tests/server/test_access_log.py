"""The access log of a live server: one JSON line per request with its ids, route, status and
tokens; no prompt text unless `logging.log_prompts` is on."""

from __future__ import annotations

import io
import json
import logging
import time

import httpx
import pytest

from conftest import server_settings
from live_server import live_server

SECRET_WORDS = "zebra marmalade quartz"


@pytest.fixture()
def access_log():
    from rebar.obs.logs import JsonFormatter, RequestContextFilter

    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestContextFilter())
    logger = logging.getLogger("rebar")
    saved_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield buffer
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)


def served(served_models, **settings):
    from rebar.engine.async_engine import AsyncEngine
    from rebar.server.app import create_app

    served_models.engine = AsyncEngine(served_models.chat.engine)
    return live_server(create_app(server_settings(**settings), served_models))


def entries(buffer: io.StringIO, request_id: str, timeout: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [json.loads(line) for line in buffer.getvalue().splitlines()]
        mine = [e for e in found if e.get("request_id") == request_id]
        if any(e["logger"] == "rebar.access" for e in mine) or time.monotonic() > deadline:
            return mine
        time.sleep(0.02)


def chat(url: str, request_id: str, **extra) -> httpx.Response:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": f"Repeat: {SECRET_WORDS}"}],
        "max_tokens": 4,
        "temperature": 0.7,
        **extra,
    }
    return httpx.post(
        url + "/v1/chat/completions", json=body, headers={"X-Request-ID": request_id}, timeout=120
    )


def test_access_line_per_request_without_prompt_text(served_models, access_log) -> None:
    with served(served_models) as url:
        response = chat(url, "log-plain-1")
        streamed = chat(url, "log-stream-1", stream=True)
        bad = chat(url, "log-bad-1", model="nope")
        lines = {
            rid: entries(access_log, rid) for rid in ("log-plain-1", "log-stream-1", "log-bad-1")
        }
    assert [r.status_code for r in (response, streamed, bad)] == [200, 200, 400]
    (plain,) = [e for e in lines["log-plain-1"] if e["logger"] == "rebar.access"]
    usage = response.json()["usage"]
    assert (
        plain["route"] == "/v1/chat/completions"
        and plain["method"] == "POST"
        and plain["status"] == 200
    )
    assert plain["trace_id"] == response.headers["x-trace-id"]
    assert (
        plain["prompt_tokens"] == usage["prompt_tokens"]
        and plain["completion_tokens"] == usage["completion_tokens"]
    )
    assert plain["duration_ms"] > 0 and plain["prefill_ms"] > 0 and plain["level"] == "info"

    (stream_line,) = [e for e in lines["log-stream-1"] if e["logger"] == "rebar.access"]
    assert (
        stream_line["status"] == 200 and stream_line["completion_tokens"] >= 1
    )  # known only at the stream's end
    (bad_line,) = [e for e in lines["log-bad-1"] if e["logger"] == "rebar.access"]
    assert bad_line["status"] == 400 and "prompt_tokens" not in bad_line
    assert "zebra" not in access_log.getvalue()


def test_log_prompts_puts_prompt_and_completion_in_the_access_line(
    served_models, access_log
) -> None:
    with served(served_models, **{"logging.log_prompts": True}) as url:
        response = chat(url, "log-prompts-1")
        (line,) = [e for e in entries(access_log, "log-prompts-1") if e["logger"] == "rebar.access"]
    assert SECRET_WORDS in line["prompt"]
    assert line["completions"] == [response.json()["choices"][0]["message"]["content"]]
