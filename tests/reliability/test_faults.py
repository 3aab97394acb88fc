"""Faults: an engine step that throws, a storm of clients leaving, SIGTERM under load, no room for
logs.

(Redis killed and restarted under load is tests/server/test_redis_failover.py.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from suite import scaled

from live_server import assert_idle, chat_core, free_port, server_settings, serving_models
from markers import requires_minilm, requires_smollm2
from suite_tiers import limit
from waiting import HANG_S

pytestmark = limit("soak")  # tests/suite_tiers.py

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
POISON = " zebra-quokka-fault "  # a prompt holding this makes the injected fault fire
SECRET = "/secret/internal/path.py line 42"


@pytest.fixture(scope="module")
def server(served_models):
    with serving_models(served_models, server_settings()) as (url, app):
        yield url, app


def completion(url: str, prompt: str, **fields) -> httpx.Response:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0, **fields}
    return httpx.post(
        url + COMPLETIONS, json=body, headers={"cache-control": "no-cache"}, timeout=120
    )


class PoisonedRunner:
    """Wraps the model runner: any step holding a request whose prompt held POISON raises."""

    def __init__(self, runner, tokenizer) -> None:
        self.runner, self.marker = runner, tokenizer.encode(POISON)[1:-1]
        self.poisoned: set[str] = set()
        self.num_faults = 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, items):
        self._fail_if_poisoned(items)
        return self.runner.execute(items)

    def execute_greedy(self, items):  # a step whose rows are all plain greedy
        self._fail_if_poisoned(items)
        return self.runner.execute_greedy(items)

    def _fail_if_poisoned(self, items) -> None:
        for item in items:
            ids = list(item.token_ids)
            if any(ids[i : i + len(self.marker)] == self.marker for i in range(len(ids))):
                self.poisoned.add(item.request_id)
        if any(item.request_id in self.poisoned for item in items):
            self.num_faults += 1
            raise RuntimeError(f"injected fault at {SECRET}")


def test_an_engine_fault_fails_its_request_alone_with_a_clean_500(server) -> None:
    url, app = server
    core = chat_core(app)
    prompts = ["The capital of France is", "One, two, three,", "Water boils at"]
    expected = [completion(url, p).json()["choices"][0]["text"] for p in prompts]
    original = core.runner
    core.runner = PoisonedRunner(original, core.tokenizer)
    try:
        with ThreadPoolExecutor(4) as pool:
            poisoned = pool.submit(completion, url, "Tell me about" + POISON + "animals")
            healthy = list(pool.map(lambda p: completion(url, p), prompts))
            stream = pool.submit(completion, url, "And" + POISON, stream=True)
            failed, streamed = poisoned.result(), stream.result()
    finally:
        core.runner = original
    assert core.runner is original and chat_core(app).runner is original
    assert [r.status_code for r in healthy] == [200] * 3
    assert [
        r.json()["choices"][0]["text"] for r in healthy
    ] == expected  # untouched by the neighbour's fault
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert (
        error["type"] == "server_error"
        and SECRET not in failed.text
        and "injected" not in failed.text
    )
    assert streamed.status_code == 200  # a stream's fault arrives as an error event, then [DONE]
    events = [line[6:] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
    assert (
        any('"error"' in e for e in events)
        and events[-1] == "[DONE]"
        and SECRET not in streamed.text
    )
    assert_idle(app)
    assert (
        completion(url, prompts[0]).json()["choices"][0]["text"] == expected[0]
    )  # and it recovers


def test_a_storm_of_clients_leaving_mid_stream_leaves_nothing_behind(server) -> None:
    url, app = server
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": "smollm2",
            "prompt": "Write a very long story:",
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    request = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    def leave(delay_s: float) -> None:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(request)
            time.sleep(delay_s)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )  # RST

    clients = int(scaled(48, 400))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(leave, [0.01 * (i % 30) for i in range(clients)]))
    assert_idle(app, timeout=30)
    assert completion(url, "The capital of France is").status_code == 200


def serve(tmp_path, log, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    environment = {
        **os.environ,
        "REBAR_ENGINE__MAX_MODEL_LEN": "1024",
        "REBAR_ENGINE__KV_CACHE_MEMORY": str(128 * 2**20),
        **(env or {}),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "rebar.cli", "serve", "--port", str(port), *args],
        env=environment,
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        assert process.poll() is None, "the server exited while starting"
        time.sleep(0.2)
    process.kill()
    raise AssertionError("the server never became ready")


@requires_smollm2
@requires_minilm
def test_sigterm_under_load_drains_and_exits_0(tmp_path) -> None:
    drain_s = 20
    with open(tmp_path / "server.log", "w") as log:
        process, url = serve(tmp_path, log, env={"REBAR_SERVER__DRAIN_TIMEOUT_S": str(drain_s)})
    try:
        outcomes: list[str] = []

        def stream(i: int) -> None:
            body = {
                "model": "smollm2",
                "prompt": f"Story {i}:",
                "max_tokens": 48,
                "ignore_eos": True,
                "stream": True,
            }
            try:
                with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=60) as response:
                    text = "".join(response.iter_text())
                outcomes.append(
                    "done" if "data: [DONE]" in text else "error" if '"error"' in text else "cut"
                )
            except httpx.HTTPError:
                outcomes.append("refused")  # arrived after the listener closed

        def abandoned_embeddings() -> None:  # a big job whose client gives up at once
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(
                    url + "/v1/embeddings",
                    json={"model": "minilm", "input": ["text"] * 2048},
                    timeout=0.5,
                )

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        threads += [threading.Thread(target=abandoned_embeddings) for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)  # streams are producing, embeddings abandoned
        process.send_signal(signal.SIGTERM)
        # The server exits by itself (code 0 below); the wait only bounds a hang.
        code = process.wait(timeout=drain_s + HANG_S)
        for thread in threads:
            thread.join(60)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 0, (tmp_path / "server.log").read_text()[-2000:]
    assert outcomes.count("done") >= 1 and "cut" not in outcomes, outcomes


@requires_smollm2
def test_a_full_disk_for_the_logs_does_not_stop_the_server(tmp_path) -> None:
    with open("/dev/full", "w") as full:
        process, url = serve(tmp_path, full, "--embedding-model", "none")
    try:
        for _ in range(3):
            response = completion(url, "The capital of France is", max_tokens=4)
            assert response.status_code == 200
        assert (
            httpx.post(
                url + COMPLETIONS, json={"model": "nope", "prompt": "x"}, timeout=30
            ).status_code
            == 400
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=40) == 0
    finally:
        if process.poll() is None:
            process.kill()
