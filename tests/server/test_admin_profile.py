"""POST /admin/profile: closed without admin keys, its own keys, a Chrome trace of live engine
steps."""

from __future__ import annotations

import threading

import httpx
import pytest

from conftest import server_settings
from live_server import live_server

ADMIN_KEY = "admin-secret-1"
USER_KEY = "user-key-1"


@pytest.fixture(scope="module")
def admin_server(served_models):
    from rebar.engine.async_engine import AsyncEngine
    from rebar.server.app import create_app

    served_models.engine = AsyncEngine(served_models.chat.engine)
    settings = server_settings(
        **{"server.admin_api_keys": [ADMIN_KEY], "server.api_keys": [USER_KEY]}
    )
    with live_server(create_app(settings, served_models)) as url:
        yield url


def profile(url: str, key: str | None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/admin/profile", json=body, headers=headers, timeout=120)


def test_admin_endpoint_is_closed_when_no_admin_key_is_configured(served_models) -> None:
    from fastapi.testclient import TestClient

    from rebar.server.app import create_app

    client = TestClient(create_app(server_settings()))
    response = client.post("/admin/profile", json={"steps": 1})
    assert response.status_code == 403 and response.json()["error"]["code"] == "admin_disabled"


def test_admin_keys_are_separate_from_api_keys(admin_server) -> None:
    for key in (None, USER_KEY, "wrong"):
        response = profile(admin_server, key, steps=1, timeout_s=0.1)
        assert response.status_code == 401, key
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert profile(admin_server, ADMIN_KEY, steps=0).status_code == 400
    assert profile(admin_server, ADMIN_KEY, steps=1, unknown=True).status_code == 400


def test_profile_of_live_generation_has_layer_ranges_and_top_operators(admin_server) -> None:
    body = {
        "model": "smollm2",
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "ignore_eos": True,
        "temperature": 0,
    }
    done = threading.Event()
    results: list[httpx.Response] = []

    def generate() -> None:
        results.append(
            httpx.post(
                admin_server + "/v1/completions",
                json=body,
                timeout=120,
                headers={"Authorization": f"Bearer {USER_KEY}"},
            )
        )
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    response = profile(admin_server, ADMIN_KEY, steps=3, timeout_s=60, top=7)
    worker.join(120)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "profile" and data["steps_profiled"] == 3
    assert len(data["top_operators"]) == 7 and all(
        op["self_ms"] >= 0 for op in data["top_operators"]
    )
    names = {event.get("name") for event in data["trace"]["traceEvents"]}
    # a step through the model's forward has a range per layer; a decode step through the fused CPU
    # step (the default for this quantized model) is one range
    assert {
        "layers.0",
        "layers.29",
        "layers.0.attn",
        "layers.29.mlp",
    } <= names or "fused_decode_step" in names
    assert results[0].status_code == 200 and results[0].json()["usage"]["completion_tokens"] == 24


def test_idle_engine_profile_ends_at_its_deadline(admin_server) -> None:
    response = profile(admin_server, ADMIN_KEY, steps=50, timeout_s=0.3)
    assert response.status_code == 200 and response.json()["steps_profiled"] == 0
