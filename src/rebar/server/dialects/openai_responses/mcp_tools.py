"""The request's `{"type": "mcp"}` tools: read and checked against what the operator allows
(`[mcp]` servers and `allowed_urls`), then connected and listed into a `Toolbox` whose tools the
model sees as functions.

A label that names no configured server, a `server_url` not allowed, or an approval mode other
than "never" is a 400 naming the tool; a server that cannot be reached or listed is a 424.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rebar.agents.mcp_servers import Connection, McpServers, McpTool, ServerTarget, ToolServerError
from rebar.errors import InvalidRequestError
from rebar.server.errors import APIError
from rebar.server.pipeline.request import FunctionTool

MCP_FIELDS = {
    "type",
    "server_label",
    "server_url",
    "server_description",
    "allowed_tools",
    "require_approval",
}


@dataclass(frozen=True)
class McpRequestTool:
    """One `mcp` entry of `tools`: where it was, the server it reaches."""

    param: str
    target: ServerTarget


@dataclass
class Toolbox:
    """The listed MCP tools of one request: each server's listing (for its `mcp_list_tools`
    item), the tools as functions for the prompt, and which connection runs each tool."""

    listings: list[tuple[str, list[McpTool]]] = field(default_factory=list)
    functions: list[FunctionTool] = field(default_factory=list)
    routes: dict[str, tuple[str, Connection]] = field(default_factory=dict)

    def label_of(self, name: str) -> str | None:
        route = self.routes.get(name)
        return route[0] if route else None


def has_mcp(tools: list[dict[str, Any]] | None) -> bool:
    return any(tool.get("type") == "mcp" for tool in tools or ())


def mcp_tools(tools: list[dict[str, Any]], servers: McpServers) -> list[McpRequestTool]:
    """The `mcp` entries of `tools`, each resolved to a server the operator allows."""
    found: list[McpRequestTool] = []
    for i, tool in enumerate(tools):
        if tool.get("type") == "mcp":
            found.append(_resolve(tool, f"tools.{i}", servers))
    labels = [t.target.label for t in found]
    for label in labels:
        if labels.count(label) > 1:
            raise InvalidRequestError(f"two mcp tools share server_label {label!r}", "tools")
    return found


def _resolve(tool: dict[str, Any], where: str, servers: McpServers) -> McpRequestTool:
    extra = sorted(set(tool) - MCP_FIELDS)
    if extra:
        raise InvalidRequestError(f"{where} has unsupported fields {extra}", f"{where}.{extra[0]}")
    label = tool.get("server_label")
    if not isinstance(label, str) or not label:
        raise InvalidRequestError(f"{where}.server_label must be a non-empty string", where)
    approval = tool.get("require_approval", "never")
    if approval != "never":
        raise InvalidRequestError(
            f"{where}.require_approval {approval!r} is not supported: rebar has no approval "
            "flow, give 'never'",
            f"{where}.require_approval",
        )
    url = tool.get("server_url")
    if url is not None:
        if not isinstance(url, str) or not servers.url_allowed(url):
            raise InvalidRequestError(
                f"{where}.server_url {url!r} is not one of the server's [mcp] allowed_urls",
                f"{where}.server_url",
            )
        target = ServerTarget(label, url=url)
    else:
        configured = servers.configured.get(label)
        if configured is None:
            raise InvalidRequestError(
                f"{where}: no MCP server labelled {label!r} is configured (and no server_url "
                "given)",
                f"{where}.server_label",
            )
        target = configured
    allowed = _allowed(tool.get("allowed_tools"), f"{where}.allowed_tools")
    if allowed is not None:
        narrowed = allowed if target.allowed_tools is None else allowed & target.allowed_tools
        target = replace(target, allowed_tools=narrowed)
    return McpRequestTool(where, target)


def _allowed(value: Any, where: str) -> frozenset[str] | None:
    """`allowed_tools` as a list of names or OpenAI's filter `{"tool_names": [...]}`."""
    if value is None:
        return None
    if isinstance(value, dict):
        if set(value) - {"tool_names"}:
            raise InvalidRequestError(f"{where} filters by tool_names only", where)
        value = value.get("tool_names", [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequestError(f"{where} must be a list of tool names", where)
    return frozenset(value)


async def open_toolbox(
    requested: list[McpRequestTool], servers: McpServers, taken: set[str]
) -> Toolbox:
    """Connect to each server and list its tools; `taken` holds the request's function names
    (a tool may not shadow one, nor another server's tool)."""
    box = Toolbox()
    for tool in requested:
        target = tool.target
        try:
            connection = await servers.connection(target)
            listed = await connection.list_tools(servers.connect_timeout_s, target.allowed_tools)
        except ToolServerError as exc:
            raise APIError(424, str(exc), tool.param, "mcp_server_unavailable") from None
        for item in listed:
            if item.name in taken or item.name in box.routes:
                raise InvalidRequestError(
                    f"{tool.param}: tool {item.name!r} of {target.label!r} has the name of "
                    "another tool of this request",
                    tool.param,
                )
            box.routes[item.name] = (target.label, connection)
            box.functions.append(FunctionTool(item.name, item.description, item.input_schema))
        box.listings.append((target.label, listed))
    return box
