"""Fuzzing the HTTP API from its own OpenAPI schema: never a 5xx, never a hang, nothing left behind.

Schemathesis generates bodies that fit the schema and bodies that break it (wrong types, missing
and extra fields, odd strings). Each case is sent to a live server; afterwards admission
tickets, queued embeddings and KV blocks must all be back to idle.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from suite import scaled

from live_server import assert_idle, chat_core, server_settings, serving_models

MAX_EXAMPLES = int(scaled(12, 300))
# Generation lengths are clamped so a case costs at most a few seconds of engine time; the
# parameters' validation is still fuzzed, since only well-typed, in-range values are clamped.
MAX_FUZZ_TOKENS = 8
MAX_FUZZ_N = 2


def _schema() -> dict:
    from rebar.config import load_settings
    from rebar.server.app import create_app

    return create_app(load_settings(None, {})).openapi()  # no models load until the app starts


schema = schemathesis.openapi.from_dict(_schema())


@pytest.fixture(scope="module")
def fuzz_server(served_models):
    with serving_models(served_models, server_settings()) as (url, app):
        yield url, app


def _bounded(body: object, served: dict[str, str]) -> object:
    """The case's body with the model pointed at a served one (so validation goes past it) and any
    valid max_tokens / n clamped to a cheap size."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if "model" in body and isinstance(body["model"], str):
        body["model"] = served["embedding" if "input" in body else "chat"]
    for key, cap in (
        ("max_tokens", MAX_FUZZ_TOKENS),
        ("max_completion_tokens", MAX_FUZZ_TOKENS),
        ("n", MAX_FUZZ_N),
    ):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
            body[key] = cap
    generates = "messages" in body or ("prompt" in body and "tokens" not in body)
    if generates and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_FUZZ_TOKENS  # None (chat's default) means "until the context ends"
    return body


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_5xx_or_leaves_anything_behind(fuzz_server, case) -> None:
    url, app = fuzz_server
    registry = app.state.rebar.registry
    names = {kind: registry.default_name(kind) for kind in ("chat", "embedding")}
    case.body = _bounded(case.body, names)
    added = chat_core(app).num_requests_added
    response = case.call(base_url=url, timeout=60)
    assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert chat_core(app).num_requests_added == added  # nothing generated for it
    assert_idle(app)
