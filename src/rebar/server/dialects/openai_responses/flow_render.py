"""A tool loop's response as Responses items and events: the `ResponsesRenderer` of one model turn
after another, plus `mcp_list_tools` items, `mcp_call` items (their arguments streamed as the model
writes them, their output or error once the server answered) and one final event for the whole
flow."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rebar.agents.mcp_servers import McpTool, ToolResult
from rebar.server.dialects.openai_responses.render import ResponsesRenderer, new_id, usage
from rebar.server.pipeline.results import ChoiceEnd, ToolCallDelta, Usage

FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}


class FlowRenderer(ResponsesRenderer):
    """One response over several model turns. `labels` maps each MCP tool's name to its server's
    label: a call of such a tool is an `mcp_call` item, any other call a `function_call` item."""

    def __init__(self, *args: Any, labels: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.labels = labels
        self.call_ids: dict[str, str] = {}  # mcp_call item id -> the model's call id
        self._turn_items: list[dict[str, Any]] = []
        self._turn_first = 0  # where the current turn's items start in the output

    @property
    def output(self) -> list[dict[str, Any]]:
        return self._output

    # ----- listings ----------------------------------------------------------------------
    def listed(self, label: str, tools: list[McpTool]) -> Iterator[str]:
        item: dict[str, Any] = {
            "type": "mcp_list_tools",
            "id": new_id("mcpl"),
            "server_label": label,
            "tools": [],
            "error": None,
        }
        self._output.append(item)
        where = {"item_id": item["id"], "output_index": len(self._output) - 1}
        yield self._event(
            "response.output_item.added", output_index=where["output_index"], item=dict(item)
        )
        yield self._event("response.mcp_list_tools.in_progress", **where)
        item["tools"] = [_tool_entry(tool) for tool in tools]
        yield self._event("response.mcp_list_tools.completed", **where)
        yield self._event(
            "response.output_item.done", output_index=where["output_index"], item=dict(item)
        )

    # ----- the model's calls -------------------------------------------------------------
    def _call(self, delta: ToolCallDelta) -> Iterator[str]:
        if delta.id is not None:
            label = self.labels.get(delta.name) if delta.name is not None else None
            if label is None:  # a function the client runs
                yield from super()._call(delta)
                self._turn_items.append(self._calls[delta.call_index])
                return
            yield from self._open_mcp_call(delta, label)
        item = self._calls[delta.call_index]
        if item["type"] != "mcp_call":
            yield from super()._call(delta)
        elif delta.arguments:
            item["arguments"] += delta.arguments
            yield self._event(
                "response.mcp_call_arguments.delta", **self._at(item), delta=delta.arguments
            )

    def _open_mcp_call(self, delta: ToolCallDelta, label: str) -> Iterator[str]:
        yield from self._close()
        item: dict[str, Any] = {
            "type": "mcp_call",
            "id": new_id("mcp"),
            "server_label": label,
            "name": delta.name,
            "arguments": "",
            "output": None,
            "error": None,
            "status": "in_progress",
        }
        self.call_ids[item["id"]] = delta.id or ""
        self._calls[delta.call_index] = self._open = item
        self._output.append(item)
        self._turn_items.append(item)
        index = len(self._output) - 1
        yield self._event("response.output_item.added", output_index=index, item=dict(item))

    def _close(self) -> Iterator[str]:
        item = self._open
        if item is None or item["type"] != "mcp_call":
            yield from super()._close()
            return
        self._open = None  # stays in progress until the server has answered
        yield self._event(
            "response.mcp_call_arguments.done", **self._at(item), arguments=item["arguments"]
        )

    def begin_turn(self) -> None:
        self._turn_first = len(self._output)

    @property
    def turn_end(self) -> ChoiceEnd | None:
        """How the model's turn ended (None before its end)."""
        return self._end

    def turn_text(self) -> str:
        """What the model wrote this turn besides its calls."""
        items = self._output[self._turn_first :]
        return "".join(i["content"][0]["text"] for i in items if i["type"] == "message")

    def end_turn(self) -> Iterator[str]:
        """Close the turn's open item; its calls are then `turn_calls()`."""
        yield from self._close()
        self._calls = {}
        self._end = None

    def turn_calls(self) -> list[dict[str, Any]]:
        """The calls the last turn made (mcp_call and function_call items), and forget them."""
        items, self._turn_items = self._turn_items, []
        return items

    # ----- running them ------------------------------------------------------------------
    def call_started(self, item: dict[str, Any]) -> Iterator[str]:
        yield self._event("response.mcp_call.in_progress", **self._at(item))

    def call_finished(self, item: dict[str, Any], result: ToolResult) -> Iterator[str]:
        item["output"], item["error"] = result.output, result.error
        item["status"] = "completed" if result.error is None else "failed"
        kind = "completed" if result.error is None else "failed"
        yield self._event(f"response.mcp_call.{kind}", **self._at(item))
        yield self._event(
            "response.output_item.done", output_index=self._output.index(item), item=dict(item)
        )

    def call_cut(self, item: dict[str, Any], status: str) -> Iterator[str]:
        """A call whose turn ended early (`status` incomplete or failed): not run."""
        item["status"] = "incomplete" if status == "incomplete" else "failed"
        yield self._event(
            "response.output_item.done", output_index=self._output.index(item), item=dict(item)
        )

    def call_skipped(self, item: dict[str, Any], limit: int) -> Iterator[str]:
        """A call past `max_tool_calls`: not run, its error says why."""
        error = f"not run: the response reached max_tool_calls ({limit})"
        yield from self.call_finished(item, ToolResult(None, error, "skipped"))

    # ----- the end -----------------------------------------------------------------------
    def finish(
        self,
        status: str,
        total: Usage,
        incomplete: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> Iterator[str]:
        """The flow's last event, with the response as a GET returns it."""
        yield from self._close()
        self.final = self.response(
            status,
            output=self._output,
            usage=usage(total),
            incomplete_details={"reason": incomplete} if incomplete else None,
            error=error,
        )
        yield self._event(FINAL_EVENT.get(status, "response.failed"), response=self.final)

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._output.index(item)}


def _tool_entry(tool: McpTool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": tool.name,
        "input_schema": tool.input_schema,
        "description": tool.description,
    }
    if tool.annotations:
        entry["annotations"] = tool.annotations
    return entry
