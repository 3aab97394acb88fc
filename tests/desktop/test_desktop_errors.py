"""`rebar desktop` where it cannot open a window: a clear message and exit code 2, no traceback, and
no server started."""

from __future__ import annotations

import sys

import pytest

from needs import need_desktop_window, requires
from rebar.cli import main
from rebar.desktop import server as embedded_server


@pytest.fixture(autouse=True)
def no_server_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a server was started although the window cannot open")

    monkeypatch.setattr(embedded_server.subprocess, "Popen", refuse)


def test_without_pywebview(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "webview", None)  # what `import webview` sees uninstalled
    assert main(["desktop"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pywebview is not installed") and "make desktop" in err
    assert "Traceback" not in err


@requires(need_desktop_window)
def test_without_a_display(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert main(["desktop"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no display:") and "xvfb-run" in err


@requires(need_desktop_window)
def test_with_a_display_that_is_not_there(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("DISPLAY", ":4093")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert main(["desktop"]) == 2
    assert capsys.readouterr().err.startswith("error: cannot open the display ':4093'")


@requires(need_desktop_window)
def test_without_webkitgtk(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import gi

    def no_webkit(namespace: str, version: str) -> None:
        if namespace == "WebKit2":
            raise ValueError(f"Namespace {namespace} not available")

    monkeypatch.setattr(gi, "require_version", no_webkit)
    monkeypatch.setenv("DISPLAY", ":4093")
    assert main(["desktop"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the system web view is missing") and "gir1.2-webkit2-4.1" in err


def test_a_config_that_is_not_a_file(tmp_path, capsys) -> None:
    assert main(["desktop", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "is not a file" in capsys.readouterr().err
