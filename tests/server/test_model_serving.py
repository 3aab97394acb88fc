"""Several models in one live server: on-demand loads, /v1/models states and versions, the admin
calls, hot reload under streaming load (in one process, memory store), a reload refused by its
contract, a model over its budget, and one engine thread per model."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from live_server import live_server, server_settings
from markers import requires_smollm2

pytestmark = requires_smollm2

ADMIN_KEY = "admin-key-7"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MiB = 2**20


def settings_with(serve: list[dict], **overrides):
    return server_settings(
        **{
            "models.embedding": "",
            "models.serve": serve,
            "engine.max_model_len": 512,
            "engine.kv_cache_memory": 32 * MiB,
            "server.admin_api_keys": [ADMIN_KEY],
            **overrides,
        }
    )


@pytest.fixture(scope="module")
def two_models():
    """smollm2 (the pinned shorthand) and smol-b, the same weights as an on-demand entry."""
    from rebar.server.app import create_app

    app = create_app(settings_with([{"name": "smol-b", "model": "smollm2"}]))
    with live_server(app) as url:
        yield url, app


def chat(url: str, model: str, content: str = "Say hi", max_tokens: int = 4) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def models_by_id(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def stream_versions(url: str, model: str, content: str, max_tokens: int = 24) -> tuple[str, set]:
    """(the version header, the system_fingerprints of the chunks) of one streamed answer."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        header = response.headers["x-rebar-model-version"]
        fingerprints, done = set(), False
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                fingerprints.add(json.loads(line[6:])["system_fingerprint"])
    assert done
    return header, fingerprints


def test_models_list_states_and_an_on_demand_load(two_models) -> None:
    url, _ = two_models
    listed = models_by_id(url)
    assert listed["smollm2"]["state"] == "loaded" and listed["smollm2"]["pinned"]
    assert listed["smollm2"]["version"] == 1 and listed["smollm2"]["object"] == "model"
    if listed["smol-b"]["state"] != "loaded":  # another test may have loaded it already
        assert listed["smol-b"]["state"] == "unloaded" and listed["smol-b"]["memory_bytes"] == 0
    response = chat(url, "smol-b")
    assert response.status_code == 200, response.text
    assert response.headers["x-rebar-model-version"].startswith("smol-b-v")
    assert response.json()["system_fingerprint"] == response.headers["x-rebar-model-version"]
    loaded = models_by_id(url)["smol-b"]
    assert loaded["state"] == "loaded" and loaded["memory_bytes"] > 50 * MiB
    unknown = chat(url, "nope")
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "model_not_found"
    assert "smollm2, smol-b" in unknown.json()["error"]["message"]


def test_admin_calls_need_the_admin_key_and_drive_the_registry(two_models) -> None:
    url, _ = two_models
    assert httpx.get(url + "/admin/models", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(url + "/admin/models/smol-b/unload", headers=wrong).status_code == 401
    gone = httpx.post(url + "/admin/models/smol-b/unload", headers=ADMIN, timeout=60)
    assert gone.status_code == 200 and gone.json()["state"] == "unloaded"
    back = httpx.post(url + "/admin/models/smol-b/load", headers=ADMIN, timeout=120)
    assert back.status_code == 200 and back.json()["state"] == "loaded"
    listing = httpx.get(url + "/admin/models", headers=ADMIN, timeout=10).json()
    assert listing["memory_bytes"] >= sum(m["memory_bytes"] for m in listing["data"])
    assert listing["memory_budget"] > listing["memory_bytes"]
    missing = httpx.post(url + "/admin/models/nope/load", headers=ADMIN, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(
        url + "/admin/models/smol-b/reload", headers=ADMIN, json={"colour": 1}, timeout=10
    )
    assert bad.status_code == 400


def test_a_reload_under_streaming_load_loses_nothing_and_frees_the_old_version(two_models) -> None:
    url, app = two_models
    registry = app.state.rebar.registry
    slot = registry.slots["smollm2"]
    first = slot.version
    old_model = weakref.ref(slot.current.front.core.runner.model)  # the first version's weights
    stop = threading.Event()
    results: list[tuple[str, set]] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                results.append(stream_versions(url, "smollm2", f"Story {i}.{n}: once"))
            except BaseException as exc:
                errors.append(exc)

    with ThreadPoolExecutor(8) as pool:
        for i in range(8):
            pool.submit(client, i)
        time.sleep(1.0)
        outcomes = []
        for _ in range(2):
            reply = httpx.post(url + "/admin/models/smollm2/reload", headers=ADMIN, timeout=120)
            assert reply.status_code == 200, reply.text
            outcomes.append(reply.json())
            time.sleep(0.5)
        # Streams keep starting until one from the newest version has finished.
        deadline = time.monotonic() + 60
        newest = f"smollm2-v{first + 2}"
        while all(header != newest for header, _ in results) and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
    assert errors == []
    assert [o["version"] for o in outcomes] == [first + 1, first + 2]
    assert all(o["swap_ms"] < 50 and not o["drained_first"] for o in outcomes)
    for header, fingerprints in results:
        assert fingerprints == {header}  # every stream from exactly one version
    seen = {header for header, _ in results}
    assert f"smollm2-v{first}" in seen and f"smollm2-v{first + 2}" in seen, seen
    deadline = time.monotonic() + 30
    while (slot.retired or old_model() is not None) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert slot.retired == [] and old_model() is None  # the old versions' weights are gone
    assert models_by_id(url)["smollm2"]["version"] == first + 2


def test_a_reload_that_breaks_the_contract_is_refused_and_the_old_version_serves(
    two_models, tmp_path: Path
) -> None:
    from rebar.model.resolve import resolve_model_path

    url, app = two_models
    slot = app.state.rebar.registry.slots["smollm2"]
    before = slot.version
    weights = tmp_path / "next.gguf"
    os.symlink(resolve_model_path("smollm2"), weights)
    contract = (Path(__file__).parents[2] / "contracts" / "smollm2.rebar-contract.toml").read_text()
    broken = contract.replace('architecture = "llama"', 'architecture = "phi3"')
    assert broken != contract
    (tmp_path / "next.rebar-contract.toml").write_text(broken)
    reply = httpx.post(
        url + "/admin/models/smollm2/reload",
        headers=ADMIN,
        json={"path": str(weights)},
        timeout=120,
    )
    assert reply.status_code == 409, reply.text
    message = reply.json()["error"]["message"]
    assert f"v{before} keeps serving" in message and "phi3" in message
    assert slot.version == before and slot.state == "loaded" and slot.retired == []
    assert chat(url, "smollm2").headers["x-rebar-model-version"] == f"smollm2-v{before}"


def test_a_model_over_its_memory_budget_is_refused_with_the_numbers() -> None:
    from rebar.server.app import create_app

    settings = settings_with(
        [{"name": "tight", "model": "smollm2", "memory_budget": 150 * MiB}],
        **{"models.chat": ""},
    )
    with live_server(create_app(settings)) as url:
        response = chat(url, "tight")
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert "its weights take" in message and "memory budget of 150.0 MiB" in message
        assert models_by_id(url)["tight"]["state"] == "failed"
        admin = httpx.post(url + "/admin/models/tight/load", headers=ADMIN, timeout=120)
        assert admin.status_code == 409 and "150.0 MiB" in admin.json()["error"]["message"]


def test_each_model_has_its_own_engine_thread(two_models) -> None:
    """smollm2's engine is held inside a step; smol-b keeps answering meanwhile."""
    url, app = two_models
    assert chat(url, "smol-b").status_code == 200
    registry = app.state.rebar.registry
    core = registry.slots["smollm2"].current.engine.core
    held, entered = threading.Event(), threading.Event()
    released_by_the_test: list[bool] = []  # False: the step was let go by its own timeout
    original = core.step

    def held_step(*args, **kwargs):
        entered.set()
        released_by_the_test.append(held.wait(120))
        return original(*args, **kwargs)

    core.step = held_step
    try:
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(chat, url, "smollm2", "Count to three")
            assert entered.wait(30)
            other = chat(url, "smol-b", "Name a colour")  # answered while smollm2 is held
            assert other.status_code == 200 and not stuck.done()
            held.set()
            assert stuck.result(60).status_code == 200
            assert released_by_the_test[0], "smol-b waited for smollm2's held step"
    finally:
        held.set()
        core.step = original
    names = {t.name for t in threading.enumerate()}
    assert {"rebar-engine-smollm2", "rebar-engine-smol-b"} <= names
