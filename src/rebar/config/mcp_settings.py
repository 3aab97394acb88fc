"""The `[mcp]` section: the MCP servers the Responses API's tool loop may call, and its bounds.

A request names a configured server by its label, or gives a `server_url` that must be one of
`allowed_urls` (none by default): no request can make rebar reach an address the operator did not
list.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from rebar.config.base import Section, Unsettable

LABEL = r"^[A-Za-z0-9_-]{1,64}$"


class McpServerSettings(Section):
    """One `[[mcp.servers]]` entry: a streamable HTTP `url`, or a stdio `command` (with `args` and
    `env`) that rebar starts once and keeps. `allowed_tools` (unset: all) limits what the model
    sees."""

    label: str = Field(pattern=LABEL)
    url: Annotated[str | None, Unsettable] = None
    command: Annotated[str | None, Unsettable] = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    allowed_tools: Annotated[tuple[str, ...] | None, Unsettable] = None
    # Seconds one call to this server may take (unset: `[mcp] call_timeout_s`).
    call_timeout_s: Annotated[Annotated[float, Field(gt=0)] | None, Unsettable] = None

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSettings:
        if (self.url is None) == (self.command is None):
            raise ValueError(f"MCP server {self.label!r} needs either a url or a command")
        return self


class McpSettings(Section):
    """MCP tools in the Responses API: servers, allowed URLs and the tool loop's bounds."""

    servers: tuple[McpServerSettings, ...] = ()
    # `server_url`s a request may name (exact match); empty: only configured servers.
    allowed_urls: tuple[str, ...] = ()
    # Seconds one tool call may take; past it the call is cancelled and becomes an error output.
    call_timeout_s: float = Field(60.0, gt=0)
    # Seconds to connect to a server and list its tools.
    connect_timeout_s: float = Field(15.0, gt=0)
    # Tool calls of one response running at once, and calls to one server at once (all responses).
    max_parallel_calls: int = Field(8, ge=1)
    max_calls_per_server: int = Field(16, ge=1)
    # Tool calls a response may make when the request gives no `max_tool_calls`.
    max_tool_calls: int = Field(32, ge=1)
    # Seconds a whole tool loop may run (model turns and tool calls); past it the response ends
    # "incomplete".
    flow_timeout_s: float = Field(600.0, gt=0)
    # A tool's output is cut to this many characters before the model reads it.
    max_output_chars: int = Field(32768, ge=256)

    @model_validator(mode="after")
    def _unique_labels(self) -> McpSettings:
        labels = [server.label for server in self.servers]
        if len(labels) != len(set(labels)):
            raise ValueError("two [[mcp.servers]] share a label")
        return self
