"""Fuzzing the HTTP API from its own OpenAPI schema: never a 5xx, never a hang, nothing left behind.

Schemathesis generates bodies that fit the schema and bodies that break it (wrong types, missing
and extra fields, odd strings) for every route the app serves, the admin routes and /metrics
included (the schema fuzzed is the app's own with its hidden routes put back). Each case is sent to
a live server with the admin key, and its response must conform to the schema; afterwards
admission tickets, queued embeddings and KV blocks must all be back to idle.

Random cases keep generation cheap (max_tokens and n clamped); the large valid values a client may
send (max_tokens up to the context, n at its limit, the longest stop lists) have their own test on
a server with a short context, and every POST route gets bodies that are not JSON at all.

Cases are drawn from the suite's hypothesis profile (tests/conftest.py): derandomized, so CI
draws the same cases every run, or random under `make reliability`.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from suite import scaled

from dialect_errors import assert_error_shape
from live_server import assert_idle, chat_core, server_settings, serving_models
from suite_tiers import limit

pytestmark = limit("soak")  # tests/suite_tiers.py

MAX_EXAMPLES = int(scaled(12, 300))
# Generation lengths are clamped so a random case costs at most a few seconds of engine time; the
# parameters' validation is still fuzzed, since only well-typed, in-range values are clamped.
MAX_FUZZ_TOKENS = 8
MAX_FUZZ_N = 2
PROFILE_S = 0.1  # the longest an admin profile of the idle engine waits for a step
ADMIN_KEY = "fuzz-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Status and body against the schema. Not the content type: the chat page, /metrics and event
# streams answer in types their routes do not declare (text/html, text/plain, text/event-stream).
CHECKS = [not_a_server_error, response_schema_conformance]


def app_schema() -> dict:
    """The app's OpenAPI schema with every route in it, the ones it hides from /openapi.json too."""
    from fastapi.routing import APIRoute

    from rebar.config import load_settings
    from rebar.server.app import create_app

    app = create_app(load_settings(None, {}))  # no models load until the app starts

    def api_routes(routes):
        for route in routes:
            if isinstance(route, APIRoute):
                yield route
            included = getattr(route, "original_router", None)  # a router the app included
            if included is not None:
                yield from api_routes(included.routes)

    for route in api_routes(app.routes):
        route.include_in_schema = True
    app.openapi_schema = None
    return app.openapi()


SCHEMA = app_schema()
schema = schemathesis.openapi.from_dict(SCHEMA)
POST_ROUTES = sorted(path for path, ops in SCHEMA["paths"].items() if "post" in ops)


def test_the_fuzzed_schema_has_every_route_the_app_serves() -> None:
    paths = set(SCHEMA["paths"])
    assert {"/", "/metrics", "/admin/profile", "/admin/models", "/v1/chat/completions"} <= paths
    assert {"/admin/models/{name}/load", "/admin/models/{name}/reload"} <= paths
    assert {"/tokenize", "/detokenize", "/v1/embeddings", "/v1/models", "/health"} <= paths
    assert {"/v1/responses", "/v1/responses/{response_id}/cancel"} <= paths
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= paths


@pytest.fixture(scope="module")
def fuzz_server(served_models):
    settings = server_settings(**{"server.admin_api_keys": [ADMIN_KEY]})
    with serving_models(served_models, settings) as (url, app):
        yield url, app


def _bounded(body: object, served: dict[str, str], path: str) -> object:
    """The case's body with the model pointed at a served one (so validation goes past it) and any
    valid max_tokens / n / profile deadline clamped to a cheap size."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if "model" in body and isinstance(body["model"], str):
        body["model"] = served["embedding" if path == "/v1/embeddings" else "chat"]
    for key, cap in (
        ("max_tokens", MAX_FUZZ_TOKENS),
        ("max_completion_tokens", MAX_FUZZ_TOKENS),
        ("max_output_tokens", MAX_FUZZ_TOKENS),
        ("n", MAX_FUZZ_N),
    ):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
            body[key] = cap
    # An admin profile of an idle engine waits for its deadline: valid, and kept short (left out,
    # it is the route's default of 30 s: eight such cases were four minutes of the suite; at 1 s,
    # the profile cases were still 24 of the file's 65 s).
    timeout = body.get("timeout_s")
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > PROFILE_S:
        body["timeout_s"] = PROFILE_S
    if path == "/admin/profile" and "timeout_s" not in body:
        body["timeout_s"] = PROFILE_S
    generates = "messages" in body or ("prompt" in body and "tokens" not in body)
    if generates and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_FUZZ_TOKENS  # None (chat's default) means "until the context ends"
    if path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = MAX_FUZZ_TOKENS
    return body


def assert_clean(response, app, added: int, path: str = "") -> None:
    """A 4xx in its dialect's error shape with nothing generated for it, or a success; then
    idle."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert_error_shape(path, response.json())
        assert chat_core(app).num_requests_added == added  # nothing generated
    assert_idle(app)


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_5xx_or_leaves_anything_behind(fuzz_server, case) -> None:
    url, app = fuzz_server
    if case.path.endswith("/unload") or case.path.endswith("/reload"):
        # The models every other case needs stay loaded: these act on a name that is not served.
        case.path_parameters = {"name": f"not-served-{case.path_parameters.get('name', '')}"}
    registry = app.state.rebar.registry
    names = {kind: registry.default_name(kind) for kind in ("chat", "embedding")}
    case.body = _bounded(case.body, names, case.path)
    added = chat_core(app).num_requests_added
    response = case.call(base_url=url, headers=ADMIN, timeout=120)
    case.validate_response(response, checks=CHECKS)
    if "application/json" in str(response.headers.get("content-type")):
        assert_clean(response, app, added, case.path)
    else:
        assert response.status_code < 500
        assert_idle(app)


# ----- bodies that are not JSON, on every POST route ----------------------------------------------

UNPARSEABLE = [
    b"",
    b"{",
    b'{"model": "smollm2", "messages": [',
    b"not json at all",
    b'{"a": 1}{"b": 2}',
    b"\xff\xfe\x00{\x00}",
    b"[1, 2",
    b'{"model": "smollm2" "prompt": "x"}',
    b"\x00" * 64,
]


@pytest.mark.parametrize("path", POST_ROUTES)
def test_every_post_route_answers_an_unparseable_body_with_a_clean_4xx(fuzz_server, path) -> None:
    """A route that reads a body refuses what is not JSON with a 4xx; one that takes none (the
    admin load and unload) ignores it. The model named is never one the server needs."""
    import httpx

    url, app = fuzz_server
    operation = SCHEMA["paths"][path]["post"]
    reads_a_body = operation.get("requestBody", {}).get("required", False)
    target = url + path.replace("{name}", "not-served")
    for body in UNPARSEABLE:
        added = chat_core(app).num_requests_added
        response = httpx.post(
            target, content=body, headers=ADMIN | {"content-type": "application/json"}, timeout=60
        )
        if reads_a_body:
            assert 400 <= response.status_code < 500, (path, body, response.text[:300])
        assert_clean(response, app, added, path)


# ----- large valid values on a short context ------------------------------------------------------

CONTEXT = 160  # the limits server's context: "near the context" stays cheap to generate
MAX_N = 16  # SamplingParams' limit
MAX_STOP_STRINGS = 16


@pytest.fixture(scope="module")
def limits_server(served_models):
    with serving_models(served_models, server_settings(**{"engine.max_model_len": CONTEXT})) as (
        url,
        app,
    ):
        yield url, app


def _stops() -> st.SearchStrategy[list[str]]:
    text = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=4096)
    long_word = st.sampled_from(["x" * 4096, "🦀" * 1024, " the", "\n\n", "."])
    return st.lists(st.one_of(text, long_word), min_size=1, max_size=MAX_STOP_STRINGS + 1)


@given(
    route=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    max_tokens=st.one_of(
        st.integers(CONTEXT - 24, CONTEXT + 24), st.sampled_from([CONTEXT, CONTEXT - 1])
    ),
    n=st.sampled_from([1, MAX_N - 1, MAX_N, MAX_N + 1]),
    stop=st.one_of(st.none(), _stops()),
    logprobs=st.booleans(),
    stream=st.booleans(),
)
@settings(max_examples=int(scaled(6, 120)), deadline=None, suppress_health_check=list(HealthCheck))
def test_large_valid_values_are_served_or_refused_cleanly(
    limits_server, route, max_tokens, n, stop, logprobs, stream
) -> None:
    import httpx

    url, app = limits_server
    body: dict = {"model": "smollm2", "max_tokens": max_tokens, "n": n, "stop": stop}
    body |= {"temperature": 0.8, "seed": 1, "stream": stream}
    if route == "/v1/chat/completions":
        body |= {"messages": [{"role": "user", "content": "Count."}], "logprobs": logprobs}
    else:
        body |= {"prompt": "Count:", "logprobs": 5 if logprobs else None}
    added = chat_core(app).num_requests_added
    response = httpx.post(url + route, json=body, timeout=600)
    assert_clean_or_stream(response, app, added)
    if response.status_code != 200 or stream:
        return
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(n))
    assert response.json()["usage"]["completion_tokens"] <= n * max_tokens
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)


def assert_clean_or_stream(response, app, added: int) -> None:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
        assert_idle(app)
    else:
        assert_clean(response, app, added)
