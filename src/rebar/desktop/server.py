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
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from rebar.desktop.errors import DesktopError

HOST = "127.0.0.1"  # never another interface: the window is the only client meant to reach it
_POLL_S = 0.05
_READY_POLL_MAX_S = 2.0
_STOP_GRACE_S = 10.0  # the server drains open requests on SIGTERM; the window is already gone
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _dying_with(parent: int) -> Callable[[], None]:
    """What the child runs before exec: SIGTERM when `parent` exits, however (even killed)."""

    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the signal was armed
            os._exit(1)

    return arm


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
            preexec_fn=_dying_with(os.getpid()) if sys.platform == "linux" else None,
        )

    def wait_until_answering(self, timeout_s: float) -> None:
        """Return once the server answers /health; DesktopError if it exits or times out first."""
        deadline = time.monotonic() + timeout_s
        while self._get("/health")[0] != 200:
            self._check_alive("before it answered")
            if time.monotonic() > deadline:
                raise DesktopError(f"the window's server did not answer within {timeout_s:g}s")
            time.sleep(_POLL_S)

    def wait_until_ready(self, closed: threading.Event) -> str | None:
        """Poll /ready until its model is loaded (None) or failed to load (the server's reason);
        None at once when `closed` is set. DesktopError if the server exits meanwhile."""
        delay = _POLL_S
        while not closed.is_set():
            self._check_alive("while its model loaded")
            status, body = self._get("/ready")
            if status == 200:
                return None
            if body.get("status") == "failed":
                return str(body.get("error"))
            # each 503 is a line in the server's access log: ask less often as the load goes on
            closed.wait(delay)
            delay = min(delay * 1.5, _READY_POLL_MAX_S)
        return None

    def wait_for_exit(self, closed: threading.Event) -> None:
        """Block until the server exits (DesktopError) or `closed` is set (return)."""
        while not closed.wait(_POLL_S * 4):
            self._check_alive("while the window was open")

    def _check_alive(self, when: str) -> None:
        process = self._running()
        if process.poll() is not None:
            raise DesktopError(
                f"the window's server exited with code {process.returncode} {when} "
                "(its log is above)"
            )

    def _get(self, path: str) -> tuple[int, dict]:
        """(status, JSON body) of GET `path` on the server; (0, {}) when it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.base_url}{path}", timeout=2.0) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            try:
                return error.code, json.loads(error.read() or b"{}")
            except ValueError:
                return error.code, {}
        except (urllib.error.URLError, OSError, ValueError):
            return 0, {}

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
