"""`rebar serve` as a real process: settings from flags and env, readiness, graceful SIGTERM drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from live_server import free_port
from markers import requires_smollm2
from suite_tiers import limit

pytestmark = limit("processes")  # tests/suite_tiers.py


def start_server(
    tmp_path, extra_env: dict | None = None, *args: str
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "REBAR_ENGINE__MAX_MODEL_LEN": "1024",
        "REBAR_ENGINE__KV_CACHE_MEMORY": str(128 * 2**20),
        **(extra_env or {}),
    }
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - the server process writes it until it stops
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebar.cli",
            "serve",
            "--port",
            str(port),
            "--embedding-model",
            "none",
            *args,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return process, f"http://127.0.0.1:{port}"


def wait_for(url: str, path: str, status: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url + path, timeout=2).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{path} never answered {status}")


@requires_smollm2
def test_serve_drains_in_flight_requests_on_sigterm(tmp_path) -> None:
    process, url = start_server(
        tmp_path, {"REBAR_SERVER__API_KEYS": '["sekrit"]'}, "--kv-cache-dtype", "float16"
    )
    try:
        wait_for(url, "/health", 200)
        wait_for(url, "/ready", 200)
        auth = {"Authorization": "Bearer sekrit"}
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
        assert [
            m["id"] for m in httpx.get(url + "/v1/models", headers=auth, timeout=5).json()["data"]
        ] == ["smollm2"]
        result: dict = {}

        def long_request() -> None:
            body = {
                "model": "smollm2",
                "prompt": "Once upon a time",
                "max_tokens": 40,
                "ignore_eos": True,
            }
            response = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60)
            result["status"], result["body"] = response.status_code, response.json()

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.5)  # the request is being generated
        process.send_signal(signal.SIGTERM)
        thread.join(60)
        assert result["status"] == 200 and result["body"]["choices"][0]["finish_reason"] == "length"
        assert result["body"]["usage"]["completion_tokens"] == 40
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    log = (tmp_path / "server.log").read_text()
    assert "KV cache:" in log and "(float16, " in log  # the flag reached the engine


def test_invalid_setting_fails_at_start_naming_the_key(tmp_path) -> None:
    process, _ = start_server(tmp_path, {"REBAR_LIMITS__MAX_WAITING_REQUESTS": "0"})
    assert process.wait(60) == 2
    log = (tmp_path / "server.log").read_text()
    assert "limits.max_waiting_requests" in log and "Traceback" not in log


def test_unknown_kv_cache_dtype_flag_is_refused(tmp_path) -> None:
    process, _ = start_server(tmp_path, None, "--kv-cache-dtype", "int8")
    assert process.wait(60) == 2
    log = (tmp_path / "server.log").read_text()
    assert "--kv-cache-dtype" in log and "int8" in log and "Traceback" not in log


def test_missing_config_file_is_a_clean_error(tmp_path) -> None:
    process, _ = start_server(tmp_path, None, "--config", str(tmp_path / "absent.toml"))
    assert process.wait(60) == 2
    assert "absent.toml" in (tmp_path / "server.log").read_text()


def engine_child_pid(server_pid: int) -> int:
    """The engine's process among the server's children (multiprocessing adds a resource
    tracker)."""
    task = Path(f"/proc/{server_pid}/task/{server_pid}/children")
    engines = [
        int(pid)
        for pid in task.read_text().split()
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(engines) == 1, engines
    return engines[0]


@requires_smollm2
def test_engine_in_its_own_process_serves_drains_and_reports_a_crash(tmp_path) -> None:
    process, url = start_server(tmp_path, {"REBAR_ENGINE__SEPARATE_PROCESS": "true"})
    try:
        wait_for(url, "/ready", 200)
        child = engine_child_pid(process.pid)
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": True,
        }
        streamed = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'rebar_engine_step_seconds_count{kind="decode",model="smollm2"}' in metrics
        assert "rebar_kv_cache_usage_ratio" in metrics
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        structured = {
            **body,
            "stream": False,
            "ignore_eos": False,
            "max_tokens": 30,
            "temperature": 0,  # sampled digits can run past max_tokens and cut the JSON short
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema},
            },
        }
        answer = httpx.post(url + "/v1/chat/completions", json=structured, timeout=60).json()
        assert answer["choices"][0]["finish_reason"] == "stop", answer
        assert set(json.loads(answer["choices"][0]["message"]["content"])) == {"n"}
        bad = {
            **structured,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"not": {}}},
            },
        }
        refused = httpx.post(url + "/v1/chat/completions", json=bad, timeout=60)
        assert refused.status_code == 400 and "not" in refused.json()["error"]["message"]

        os.kill(child, signal.SIGKILL)  # a crash in the engine, not in the server
        wait_for(url, "/health", 503)
        ready = httpx.get(url + "/ready", timeout=5)
        assert ready.status_code == 503 and "exited" in ready.json()["error"]
        refused = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_stopped"
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    log = (tmp_path / "server.log").read_text()
    assert "the engine process exited" in log and "KV cache:" in log  # the child logs too
