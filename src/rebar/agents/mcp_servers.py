"""MCP servers as the tool loop reaches them, through the official `mcp` SDK's client.

A server is a `ServerTarget`: a streamable HTTP URL or a stdio command. Each target gets one kept
`Connection` (opened on first use and reused by every request; a stdio server's process is
started once and stays up), reopened when its transport fails. `McpServers` holds them, knows
which targets a request may reach (configured labels, allowed URLs) and bounds the calls running
at once on each server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# The MCP SDK is imported where a connection or call first needs it: its import is ~0.5 s of every
# server's start, most of which never call a tool server.
if TYPE_CHECKING:
    from mcp import Client, StdioServerParameters
    from mcp.types import CallToolResult

logger = logging.getLogger("rebar.agents")


class ToolServerError(Exception):
    """A server could not be reached or listed (the request that needs it cannot go on)."""


@dataclass(frozen=True)
class ServerTarget:
    """Where a server is: `url` (streamable HTTP) or `command` with `args` and `env` (stdio).
    `allowed_tools` (None: all) limits the tools offered from it."""

    label: str
    url: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    allowed_tools: frozenset[str] | None = None
    call_timeout_s: float | None = None  # None: the tool loop's own

    @property
    def key(self) -> str:
        """What identifies the server process or endpoint (two labels may share one)."""
        if self.url is not None:
            return self.url
        return json.dumps([self.command, *self.args, sorted(self.env.items())])


@dataclass(frozen=True)
class McpTool:
    """A tool as the server lists it."""

    name: str
    description: str | None
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None = None


@dataclass(frozen=True)
class ToolResult:
    """One call's end: `output` text, or `error` text; `outcome` is ok, error or timeout."""

    output: str | None
    error: str | None
    outcome: str


class Connection:
    """One live client session. A keeper task enters and leaves the SDK's client (its contexts
    must be entered and left in one task); any task may call through it meanwhile."""

    def __init__(self, target: ServerTarget, max_calls: int) -> None:
        self.target = target
        self.slots = asyncio.Semaphore(max_calls)
        self.client: Client | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._keeper: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self._keeper is not None and not self._keeper.done() and self.client is not None

    async def open(self, timeout_s: float) -> None:
        self._keeper = asyncio.create_task(self._keep(), name=f"rebar-mcp-{self.target.label}")
        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait(
            {ready, self._keeper}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        ready.cancel()
        if self._ready.is_set():
            return
        await self.close()
        reason = "timed out" if not done else _reason(self._keeper)
        raise ToolServerError(f"cannot connect to MCP server {self.target.label!r}: {reason}")

    async def _keep(self) -> None:
        from mcp import Client

        async with Client(_server_of(self.target), cache=None) as client:
            self.client = client
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                self.client = None

    async def list_tools(
        self, timeout_s: float, allowed: frozenset[str] | None = None
    ) -> list[McpTool]:
        """The server's tools (those in `allowed`, when given)."""
        from mcp import MCPError

        client = self._client()
        tools: list[McpTool] = []
        cursor: str | None = None
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    page = await client.list_tools(cursor=cursor)
                    tools.extend(_tool(t) for t in page.tools)
                    if not (cursor := page.next_cursor):
                        break
        except (MCPError, TimeoutError, OSError) as exc:
            raise ToolServerError(
                f"cannot list the tools of MCP server {self.target.label!r}: {exc or 'timed out'}"
            ) from None
        return [t for t in tools if allowed is None or t.name in allowed]

    async def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
        """The call's result; a failure, an error result or the timeout (waiting for a slot
        included) is its error. Cancelling the caller cancels the call on the server."""
        from mcp import MCPError

        try:
            async with asyncio.timeout(timeout_s):
                async with self.slots:
                    result = await self._client().call_tool(name, arguments)
        except TimeoutError:
            return ToolResult(None, f"the tool call timed out after {timeout_s:g} s", "timeout")
        except MCPError as exc:
            return ToolResult(None, exc.error.message, "error")
        except Exception as exc:  # the transport failed: this call's error, the flow goes on
            return ToolResult(None, f"MCP server {self.target.label!r}: {exc}", "error")
        text = result_text(result)
        if result.is_error:
            return ToolResult(None, text or "the tool failed", "error")
        return ToolResult(text, None, "ok")

    def _client(self) -> Client:
        if self.client is None:
            raise ToolServerError(f"MCP server {self.target.label!r} is not connected")
        return self.client

    async def close(self) -> None:
        self._stop.set()
        if self._keeper is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._keeper, 5.0)


class McpServers:
    """The servers requests may use: configured ones by label, and `allowed_urls`; connections
    kept per server."""

    def __init__(
        self,
        configured: Sequence[ServerTarget],
        allowed_urls: Sequence[str],
        connect_timeout_s: float,
        max_calls_per_server: int,
    ) -> None:
        self.configured = {target.label: target for target in configured}
        self.allowed_urls = frozenset(_normal(url) for url in allowed_urls)
        self.connect_timeout_s = connect_timeout_s
        self.max_calls_per_server = max_calls_per_server
        self._connections: dict[str, Connection] = {}
        self._opening = asyncio.Lock()

    def url_allowed(self, url: str) -> bool:
        return _normal(url) in self.allowed_urls

    async def connection(self, target: ServerTarget) -> Connection:
        """The kept connection to `target`, opened (again) when it has none alive."""
        async with self._opening:
            kept = self._connections.get(target.key)
            if kept is not None and kept.alive:
                return kept
            if kept is not None:
                await kept.close()
            fresh = Connection(target, self.max_calls_per_server)
            await fresh.open(self.connect_timeout_s)
            self._connections[target.key] = fresh
            return fresh

    async def close(self) -> None:
        """Close every connection (stopping the stdio servers rebar started)."""
        connections, self._connections = list(self._connections.values()), {}
        for connection in connections:
            await connection.close()


def result_text(result: CallToolResult) -> str:
    """A result's content as text: text parts as they are, structured content as JSON, other
    parts named."""
    from mcp.types import TextContent

    parts = [
        part.text if isinstance(part, TextContent) else f"[{part.type} content]"
        for part in result.content
    ]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _server_of(target: ServerTarget) -> str | StdioServerParameters:
    if target.url is not None:
        return target.url
    assert target.command is not None, "a target has a url or a command"
    from mcp import StdioServerParameters

    return StdioServerParameters(
        command=target.command, args=list(target.args), env=dict(target.env) or None
    )


def _tool(tool: Any) -> McpTool:
    annotations = tool.annotations.model_dump(exclude_none=True) if tool.annotations else None
    return McpTool(tool.name, tool.description, dict(tool.input_schema), annotations)


def _normal(url: str) -> str:
    return url.strip().rstrip("/")


def _reason(task: asyncio.Task) -> str:
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return str(exc) or type(exc).__name__
