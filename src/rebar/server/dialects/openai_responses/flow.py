"""The tool loop of one response: a model turn, the MCP calls it made run on their servers (at
once, each isolated), their results fed back, and the next turn, until the model answers or calls
a function the client runs. Once `max_tool_calls` calls have run, the next turn has no tools and
answers with what it has; calls asked beyond the bound are not run and end the response
"incomplete" (reason `max_tool_calls`), as does the loop's time limit (`flow_time_limit`).

The loop runs as its own task and hands the Responses events it renders to its consumer (the
client's stream, or a collector for a whole or background response). Cancelling the consumer
cancels the loop: its engine request is aborted and every running tool call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request

from rebar.agents.tool_runs import PendingCall, ToolLoop
from rebar.server import sse
from rebar.server.dialects.openai_responses.flow_render import FlowRenderer
from rebar.server.dialects.openai_responses.mcp_tools import Toolbox
from rebar.server.dialects.openai_responses.render import ending
from rebar.server.errors import problem_of
from rebar.server.pipeline.request import GenerationRequest, Message, PastToolCall, Tools
from rebar.server.pipeline.respond import produce
from rebar.server.pipeline.results import ChoiceEnd, StreamEnd, Usage
from rebar.server.state import ServerState

Emit = Callable[[str], None]
Gone = Callable[[], Awaitable[bool]]
_END = object()


@dataclass
class Turn:
    """What one model turn left: how it ended and its token counts."""

    end: ChoiceEnd | None
    usage: Usage


class Flow:
    """One response's tool loop. `max_tool_calls` is the request's bound on MCP calls."""

    def __init__(
        self,
        state: ServerState,
        http: Request,
        request: GenerationRequest,
        toolbox: Toolbox,
        render: FlowRenderer,
        max_tool_calls: int,
    ) -> None:
        assert state.tool_loop is not None, "tool loops are set up with the server"
        self.state, self.http, self.request = state, http, request
        self.loop: ToolLoop = state.tool_loop
        self.toolbox, self.render = toolbox, render
        self.max_tool_calls = max_tool_calls
        self.num_calls = 0
        self.usage = Usage(0, 0, 0)
        self.slots = asyncio.Semaphore(self.loop.limits.max_parallel_calls)

    async def events(self, gone: Gone | None = None) -> AsyncIterator[str]:
        """The response's events, the loop running as a task meanwhile; closing this early (the
        client left, a cancel) cancels the loop, and so does `gone` (checked while no event
        comes) telling that the client left."""
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def run() -> None:
            try:
                await self.run(queue.put_nowait)
            finally:
                queue.put_nowait(_END)

        task = asyncio.create_task(run(), name="rebar-tool-loop")
        getter: asyncio.Future[Any] | None = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter}, timeout=self.state.ping_interval_s)
                if not done:  # a long tool call: a keep-alive, unless the client has left
                    if gone is not None and await gone():
                        return
                    yield sse.PING
                    continue
                text, getter = getter.result(), None
                if text is _END:
                    break
                yield text
            await task  # its failure, if any, is the consumer's
        finally:
            if getter is not None:
                getter.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def run(self, emit: Emit) -> None:
        """The whole flow under a `flow` span, its last event included."""
        tracer = self.loop.tracer
        with tracer.start_as_current_span("flow") as span:
            for text in self.render.stream_start():
                emit(text)
            for label, tools in self.toolbox.listings:
                for text in self.render.listed(label, tools):
                    emit(text)
            status, reason, error = await self._bounded(emit)
            span.set_attribute("rebar.flow.status", status)
            span.set_attribute("rebar.flow.tool_calls", self.num_calls)
            self.loop.metrics.flows.labels(status).inc()
            for text in self.render.finish(status, self.usage, reason, error):
                emit(text)

    async def _bounded(self, emit: Emit) -> tuple[str, str | None, dict[str, Any] | None]:
        """(status, incomplete reason, error) of the turns, within the loop's time limit."""
        try:
            async with asyncio.timeout(self.loop.limits.flow_timeout_s):
                return await self._turns(emit)
        except TimeoutError:
            return "incomplete", "flow_time_limit", None
        except Exception as exc:  # a turn the engine refused or failed: the response failed
            problem = problem_of(exc)
            return (
                "failed",
                None,
                {"code": problem.code or "server_error", "message": problem.message},
            )

    async def _turns(self, emit: Emit) -> tuple[str, str | None, dict[str, Any] | None]:
        messages = list(self.request.messages or ())
        tools = self.request.tools
        for number in range(self.max_tool_calls + 1):
            turn = await self._model_turn(number, messages, tools, emit)
            self._add_usage(turn.usage)
            status, incomplete, error = ending(
                turn.end.finish_reason if turn.end else None, turn.end.error if turn.end else None
            )
            calls = self.render.turn_calls()
            mcp_calls = [item for item in calls if item["type"] == "mcp_call"]
            if status != "completed" or not mcp_calls:
                for item in mcp_calls:  # cut short with the turn: never run
                    for text in self.render.call_cut(item, status):
                        emit(text)
                return status, (incomplete or {}).get("reason"), error
            over = await self._run_calls(mcp_calls, emit)
            if over:
                return "incomplete", "max_tool_calls", None
            if len(mcp_calls) < len(calls):  # a function the client runs: its turn now
                return "completed", None, None
            messages += self._fed_back(turn, mcp_calls)
            # Later turns choose freely; once the calls are spent, they answer with what they have.
            spent = self.num_calls >= self.max_tool_calls
            tools = (
                replace(tools, choice="none" if spent else "auto", forced=None) if tools else None
            )
        return "incomplete", "max_tool_calls", None

    async def _model_turn(
        self, number: int, messages: list[Message], tools: Tools | None, emit: Emit
    ) -> Turn:
        request = replace(self.request, messages=tuple(messages), tools=tools, stream=True)
        if tools is not None and (tools.forced is not None or tools.choice == "required"):
            # A forced turn writes calls, not text: `text.format` is for the turns that answer.
            request = replace(request, params=replace(request.params, structured=None))
        self.render.begin_turn()
        with self.loop.tracer.start_as_current_span(
            "model turn", attributes={"rebar.turn": number}
        ):
            outcome, _ = await produce(self.state, self.http, request)
            assert outcome.items is not None, "a streamed request streams"
            usage = Usage(0, 0, 0)
            try:
                async for item in outcome.items:
                    if isinstance(item, StreamEnd):
                        usage = item.usage
                        continue
                    for text in self.render.stream_item(item):
                        emit(text)
            finally:
                await outcome.items.aclose()
            end = self.render.turn_end
            for text in self.render.end_turn():
                emit(text)
            return Turn(end, usage)

    async def _run_calls(self, items: list[dict[str, Any]], emit: Emit) -> bool:
        """Run the turn's MCP calls, those within `max_tool_calls`; True when some were over."""
        room = max(self.max_tool_calls - self.num_calls, 0)
        runs, skipped = items[:room], items[room:]
        pending = [self._pending(item) for item in runs]
        for item in runs:
            for text in self.render.call_started(item):
                emit(text)
        self.num_calls += len(runs)
        by_key = {item["id"]: item for item in items}
        async with contextlib.aclosing(self.loop.run_all(pending, self.slots)) as results:
            async for call, result in results:
                for text in self.render.call_finished(by_key[call.key], result):
                    emit(text)
        for item in skipped:
            self.loop.metrics.calls.labels(item["server_label"], "skipped").inc()
            for text in self.render.call_skipped(item, self.max_tool_calls):
                emit(text)
        return bool(skipped)

    def _pending(self, item: dict[str, Any]) -> PendingCall:
        label, connection = self.toolbox.routes[item["name"]]
        return PendingCall(item["id"], label, connection, item["name"], item["arguments"])

    def _fed_back(self, turn: Turn, items: list[dict[str, Any]]) -> list[Message]:
        """The turn as the next prompt sees it: the assistant's calls, then each result."""
        ids = self.render.call_ids
        calls = tuple(PastToolCall(ids[i["id"]], i["name"], i["arguments"]) for i in items)
        said = self.render.turn_text()
        fed = [Message("assistant", said, "tools", tool_calls=calls)]
        for item in items:
            text = item["output"] if item["error"] is None else f"error: {item['error']}"
            fed.append(Message("tool", text, "tools", tool_call_id=ids[item["id"]]))
        return fed

    def _add_usage(self, more: Usage) -> None:
        u = self.usage
        self.usage = Usage(
            u.prompt_tokens + more.prompt_tokens,
            u.completion_tokens + more.completion_tokens,
            u.cached_tokens + more.cached_tokens,
        )
