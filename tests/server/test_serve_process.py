"""`rebar serve` as a real process: settings from flags and env, readiness, graceful SIGTERM drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from live_server import free_port
from markers import requires_smollm2


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
    assert "KV cache:" in log and "torch.float16" in log  # the flag reached the engine


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
