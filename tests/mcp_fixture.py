"""A small MCP server for the tool-loop tests, written with the `mcp` SDK's server API.

Run it over stdio (`python mcp_fixture.py stdio`) or serve it over streamable HTTP in the test's
own process (`serve_http`), where the test can read `RUNNING` (the tool calls in progress now).

Tools: `echo` (its text back), `add`, `meet` (returns only once `parties` calls of the same
`group` are in progress at the same time: a proof that calls overlap; a call left alone for
`wait_s` fails, and stops counting as a party before its reply leaves),
`fail` (raises), `hang` (never returns; counted in `RUNNING` until cancelled).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

MEET_WAIT_S = 30.0
RUNNING: Counter[str] = Counter()  # tool name -> calls in progress (HTTP server only)
_groups: dict[str, asyncio.Event] = {}
_arrived: Counter[str] = Counter()

server = MCPServer("rebar-test-tools")


@contextmanager
def _running(name: str) -> Iterator[None]:
    RUNNING[name] += 1
    try:
        yield
    finally:
        RUNNING[name] -= 1


@server.tool()
def echo(text: str) -> str:
    """Repeat the text."""
    return text


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
async def meet(group: str, parties: int = 2, wait_s: float = MEET_WAIT_S) -> str:
    """Wait until `parties` calls of `group` are in progress together."""
    with _running("meet"):
        event = _groups.setdefault(group, asyncio.Event())
        _arrived[group] += 1
        if _arrived[group] >= parties:
            event.set()
        try:
            await asyncio.wait_for(event.wait(), wait_s)
        except TimeoutError:
            raise ToolError(f"only {_arrived[group]} of {parties} arrived") from None
        finally:
            if not event.is_set():  # left alone (cancelled or timed out): no longer waiting
                _arrived[group] -= 1
        return f"met {group}"


@server.tool()
def fail(message: str) -> str:
    """Always fails with `message`."""
    raise ToolError(message)


@server.tool()
async def hang() -> str:
    """Never returns (until cancelled): a tool that outlives any timeout."""
    with _running("hang"):
        await asyncio.Event().wait()
        return "woke"


@contextmanager
def serve_http() -> Iterator[str]:
    """The server on streamable HTTP on a free loopback port, in a thread; yields its URL."""
    import uvicorn

    from live_server import free_port

    port = free_port()
    config = uvicorn.Config(
        server.streamable_http_app(), host="127.0.0.1", port=port, log_level="warning"
    )
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    from waiting import wait_until

    assert wait_until(lambda: http.started, 30), "the MCP test server did not start"
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        http.should_exit = True
        thread.join(10)


if __name__ == "__main__":
    if sys.argv[1:] != ["stdio"]:
        sys.exit("usage: mcp_fixture.py stdio")
    server.run("stdio")
