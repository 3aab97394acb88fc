"""The window's own `rebar serve`: a child process on 127.0.0.1 and a free port, with a fresh
random API key, stopped with the window (and, on Linux, with the process that started it, however
that one ends)."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from rebar.desktop.errors import DesktopError

HOST = "127.0.0.1"  # never another interface: the window is the only client meant to reach it
_POLL_S = 0.05
_STOP_GRACE_S = 10.0  # the server drains open requests on SIGTERM; the window is already gone
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it exits (even killed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedServer:
    """A `rebar serve` child bound to 127.0.0.1:`port` that accepts only `key` on its API."""

    def __init__(
        self, model: str | None = None, config: Path | None = None, embedding_model: str = "none"
    ) -> None:
        self.port = free_port()
        self.key = secrets.token_urlsafe(32)
        self._model = model
        self._embedding_model = embedding_model
        self._config = config
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def page_url(self) -> str:
        """The chat page, with the key in the fragment: the page uses it and drops it from the
        address; a fragment is never sent to the server."""
        return f"{self.base_url}/#key={self.key}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def command(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "rebar.cli",
            "serve",
            "--host",
            HOST,
            "--port",
            str(self.port),
        ]
        if self._model is not None:
            argv += ["--model", self._model]
        argv += ["--embedding-model", self._embedding_model]
        if self._config is not None:
            argv += ["--config", str(self._config)]
        return argv

    def start(self) -> None:
        # The key goes through the environment (readable only by this user), never the command
        # line, which every local user can list.
        env = {**os.environ, "REBAR_SERVER__API_KEYS": json.dumps([self.key])}
        self._process = subprocess.Popen(
            self.command(),
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )

    def wait_until_answering(self, timeout_s: float) -> None:
        """Return once the server answers /health; DesktopError if it exits or times out first."""
        process = self._running()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise DesktopError(
                    f"the window's server exited with code {process.returncode} before it "
                    "answered (its log is above)"
                )
            if self._answers():
                return
            time.sleep(_POLL_S)
        raise DesktopError(f"the window's server did not answer within {timeout_s:g}s")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=1.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL past the grace period; the exit code (None if never started)."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        return self._process.returncode

    def _running(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise RuntimeError("EmbeddedServer.start() was not called")
        return self._process
