"""`rebar models list | load | unload | reload` against a live server's admin endpoints."""

from __future__ import annotations

import pytest

from live_server import live_server, server_settings
from markers import requires_smollm2
from rebar.cli import main

pytestmark = requires_smollm2
KEY = "admin-cli-key"


@pytest.fixture(scope="module")
def url():
    from rebar.server.app import create_app

    settings = server_settings(
        **{
            "models.embedding": "",
            "models.serve": [{"name": "spare", "model": "smollm2", "keep_alive_s": 600}],
            "engine.max_model_len": 512,
            "engine.kv_cache_memory": 32 * 2**20,
            "server.admin_api_keys": [KEY],
        }
    )
    with live_server(create_app(settings)) as base:
        yield base


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["models", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_load_unload_and_reload(url, capsys, monkeypatch) -> None:
    monkeypatch.setenv("REBAR_ADMIN_KEY", KEY)
    code, out, _ = run(capsys, "list", "--url", url)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["MODEL", "KIND", "STATE", "VER", "MEMORY", "PATH"]
    assert lines[1].split()[:4] == ["smollm2", "chat", "loaded", "v1"] and "pinned" in lines[1]
    assert lines[2].split()[:4] == ["spare", "chat", "unloaded", "v1"]
    assert lines[-1].startswith("memory: ") and "MiB" in lines[-1]
    code, out, _ = run(capsys, "load", "spare", "--url", url)
    assert code == 0 and out.split()[:3] == ["spare", "chat", "loaded"]
    code, out, _ = run(capsys, "reload", "spare", "--url", url)
    assert code == 0 and out.startswith("spare: v1 -> v2 (smollm2), loaded in ")
    assert "announced to 0 other server processes" in out
    code, out, _ = run(capsys, "unload", "spare", "--url", url)
    assert code == 0 and out.split()[:4] == ["spare", "chat", "unloaded", "v2"]


def test_errors_are_one_line_and_exit_2(url, capsys, monkeypatch) -> None:
    monkeypatch.delenv("REBAR_ADMIN_KEY", raising=False)
    code, _, err = run(capsys, "list", "--url", url)
    assert code == 2 and "--admin-key or REBAR_ADMIN_KEY" in err
    code, _, err = run(capsys, "list", "--url", url, "--admin-key", "wrong")
    assert code == 2 and "GET /admin/models: 401" in err
    code, _, err = run(capsys, "load", "nope", "--url", url, "--admin-key", KEY)
    assert code == 2 and "404" in err and "available: smollm2, spare" in err
    code, _, err = run(capsys, "list", "--url", "http://127.0.0.1:9", "--admin-key", KEY)
    assert code == 2 and "cannot reach http://127.0.0.1:9" in err
