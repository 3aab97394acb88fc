"""MCP tools in the Responses API against real MCP servers written with the `mcp` SDK (tests/
mcp_fixture.py), one over streamable HTTP in this process and one over stdio that rebar starts:
listing, forced calls whose outputs the server computed, a failing tool, one that hangs past its
timeout, calls overlapping in time, streamed MCP events, cancel mid-tool and mid-generation and a
client that leaves (no tool call, engine request or KV block left), bad tools as 400s, and the
flow on /metrics, in spans and in the JSON log."""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path

import httpx
import pytest

from live_server import assert_idle, live_server, server_settings
from needs import need_module
from waiting import wait_until

openai = need_module("openai")
need_module("mcp")

import mcp_fixture  # noqa: E402  (needs the mcp SDK)

FIXTURE = str(Path(__file__).resolve().parents[1] / "mcp_fixture.py")
STDIO = "local"  # the configured stdio server's label
STDIO_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def mcp_url():
    with mcp_fixture.serve_http() as url:
        yield url


@pytest.fixture(scope="module")
def traced(served_models, mcp_url):
    """(url, app, span exporter) of a server allowed to reach the HTTP server, with the stdio
    server configured (its calls time out after STDIO_TIMEOUT_S)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rebar.engine.async_engine import AsyncEngine
    from rebar.obs.tracing import Tracing
    from rebar.server.app import create_app

    stdio = {
        "label": STDIO,
        "command": sys.executable,
        "args": [FIXTURE, "stdio"],
        "allowed_tools": ["echo", "fail", "hang"],
        "call_timeout_s": STDIO_TIMEOUT_S,
    }
    # A connect timeout far past every test's time limit: a connection that waited for it instead
    # of for the server's handshake would fail the tests.
    mcp = {"mcp.allowed_urls": [mcp_url], "mcp.servers": [stdio], "mcp.connect_timeout_s": 900}
    settings = server_settings(**mcp)
    exporter = InMemorySpanExporter()
    served_models.engine = AsyncEngine(served_models.chat.engine)
    app = create_app(settings, served_models, tracing=Tracing(span_exporter=exporter))
    with live_server(app, settings=settings) as url:
        yield url, app, exporter


@pytest.fixture(scope="module")
def client(traced):
    with openai.OpenAI(
        base_url=traced[0] + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as sdk:
        yield sdk


def remote(url: str, *tools: str) -> dict:
    entry = {"type": "mcp", "server_label": "remote", "server_url": url}
    return {**entry, "require_approval": "never", "allowed_tools": list(tools)}


def local(*tools: str) -> dict:
    return {"type": "mcp", "server_label": STDIO, "allowed_tools": list(tools)}


def forced(client, tool: dict, name: str, **extra):
    """A response whose first turn must call `name`; one call at most."""
    return client.responses.create(
        model="smollm2",
        input=extra.pop("input", "Use the tool."),
        tools=[tool],
        tool_choice={"type": "mcp", "server_label": tool["server_label"], "name": name},
        max_tool_calls=1,
        max_output_tokens=64,
        temperature=0,
        **extra,
    )


def items_of(response, kind: str) -> list:
    return [item for item in response.output if item.type == kind]


def assert_flow_ended(response) -> None:
    """A loop that made its one allowed call ends with an answer, or incomplete when the model
    asked for more calls than max_tool_calls."""
    assert response.status in ("completed", "incomplete"), response.status
    if response.status == "incomplete":
        assert response.incomplete_details.reason in ("max_tool_calls", "max_output_tokens")


def test_a_forced_call_runs_on_the_server_and_the_loop_goes_on(client, mcp_url, traced) -> None:
    response = forced(client, remote(mcp_url, "add"), "add", input="What is 2 plus 3?")
    (listing,) = items_of(response, "mcp_list_tools")
    assert listing.server_label == "remote"
    assert [tool.name for tool in listing.tools] == ["add"]  # allowed_tools filters the listing
    assert listing.tools[0].input_schema["properties"].keys() == {"a", "b"}
    call = items_of(response, "mcp_call")[0]
    arguments = json.loads(call.arguments)
    assert call.name == "add" and call.server_label == "remote" and call.error is None
    assert call.output == str(arguments["a"] + arguments["b"])  # computed by the server
    assert response.output.index(listing) < response.output.index(call)
    assert_flow_ended(response)
    assert response.usage.input_tokens > 0
    assert_idle(traced[1])


def test_a_configured_stdio_server_is_called_by_its_label(client) -> None:
    response = forced(client, local("echo"), "echo", input="Say hello.")
    call = items_of(response, "mcp_call")[0]
    assert call.server_label == STDIO and call.error is None
    assert call.output == json.loads(call.arguments)["text"]
    assert_flow_ended(response)


def test_a_failing_tool_is_that_calls_error_and_the_flow_goes_on(client, mcp_url) -> None:
    response = forced(client, remote(mcp_url, "fail"), "fail")
    call = items_of(response, "mcp_call")[0]
    assert call.output is None and call.status == "failed"
    assert json.loads(call.arguments)["message"] in call.error  # the server's own message
    assert_flow_ended(response)


def test_a_tool_that_hangs_past_its_timeout_is_cancelled_and_reported(client) -> None:
    response = forced(client, local("hang"), "hang")
    call = items_of(response, "mcp_call")[0]
    assert call.status == "failed" and "timed out" in call.error
    assert_flow_ended(response)


@pytest.mark.parametrize(
    ("response_slots", "server_slots", "meet"),
    [(2, 4, True), (1, 4, False), (2, 1, False)],
    ids=["concurrent", "one-per-response", "one-per-server"],
)
def test_calls_of_one_turn_run_at_once_within_their_bounds(
    mcp_url, response_slots, server_slots, meet
) -> None:
    """Two `meet` calls each wait for the other: both end well only if they run at the same
    time; a bound of one call per response or per server makes each wait alone and fail. (A lone
    party leaves on the tool server's own short limit, before its reply goes back, so the next
    call cannot meet a party whose client has already given up on it.)"""
    import asyncio

    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from rebar.agents.mcp_servers import McpServers, ServerTarget
    from rebar.agents.tool_runs import FlowLimits, PendingCall, ToolLoop
    from rebar.obs.tool_metrics import ToolMetrics

    group = f"pair-{response_slots}-{server_slots}"

    async def both():
        servers = McpServers([], [mcp_url], 30.0, server_slots)
        tracer = TracerProvider().get_tracer("test")
        loop = ToolLoop(
            servers,
            FlowLimits(call_timeout_s=10.0),
            ToolMetrics(CollectorRegistry()),
            tracer,
        )
        try:
            connection = await servers.connection(ServerTarget("remote", url=mcp_url))
            arguments = json.dumps({"group": group, "wait_s": 10.0 if meet else 0.3})
            calls = [PendingCall(k, "remote", connection, "meet", arguments) for k in "ab"]
            slots = asyncio.Semaphore(response_slots)
            return [r async for _, r in loop.run_all(calls, slots)]
        finally:
            await servers.close()

    results = asyncio.run(both())
    if meet:
        assert [r.output for r in results] == [f"met {group}"] * 2
    else:
        assert [r.outcome for r in results] == ["error", "error"]
        assert all("only 1 of 2 arrived" in r.error for r in results)


def test_a_stream_sends_the_mcp_events_in_order(client, mcp_url) -> None:
    tool = remote(mcp_url, "echo")
    with client.responses.create(
        model="smollm2",
        input="Echo the word hello.",
        tools=[tool],
        tool_choice={"type": "mcp", "server_label": "remote", "name": "echo"},
        max_tool_calls=1,
        max_output_tokens=64,
        temperature=0,
        stream=True,
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    listing = [
        "response.output_item.added",
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
        "response.output_item.done",
    ]
    assert kinds[2:6] == listing
    first = next(
        e.item.id
        for e in events
        if e.type == "response.output_item.added" and e.item.type == "mcp_call"
    )
    of_first = [e.type for e in events if getattr(e, "item_id", None) == first]
    assert of_first[0] == "response.mcp_call_arguments.delta"
    tail = ["response.mcp_call_arguments.done", "response.mcp_call.in_progress"]
    assert of_first[-3:] == [*tail, "response.mcp_call.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert kinds[-1] in ("response.completed", "response.incomplete")
    call = next(item for item in final.output if item.id == first)
    streamed = "".join(
        e.delta
        for e in events
        if e.type == "response.mcp_call_arguments.delta" and e.item_id == first
    )
    assert call.arguments == streamed and call.output == json.loads(streamed)["text"]


def test_cancelling_mid_tool_cancels_the_call_on_its_server(client, mcp_url, traced) -> None:
    queued = forced(client, remote(mcp_url, "hang"), "hang", background=True)
    assert wait_until(lambda: mcp_fixture.RUNNING["hang"] == 1), "the tool never started"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert wait_until(lambda: mcp_fixture.RUNNING["hang"] == 0), "the call kept running"
    stored = client.responses.retrieve(queued.id)
    assert stored.status == "cancelled"
    assert [item.type for item in stored.output] == ["mcp_list_tools", "mcp_call"]
    assert stored.output[1].status == "in_progress"  # what was done when it was cancelled
    assert_idle(traced[1])


def test_cancelling_mid_generation_aborts_the_engine_request(client, mcp_url, traced) -> None:
    queued = client.responses.create(
        model="smollm2",
        input="Write a very long story about a lighthouse keeper.",
        tools=[remote(mcp_url, "echo")],
        tool_choice="none",
        max_output_tokens=1500,
        temperature=0,
        extra_body={"ignore_eos": True},
        background=True,
    )
    assert client.responses.cancel(queued.id).status == "cancelled"
    assert_idle(traced[1])


def cancelled_calls(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('rebar_tool_calls_total{outcome="cancelled",server="remote"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_leaving_a_stream_cancels_its_tool_call(mcp_url, traced) -> None:
    url = traced[0]
    body = {
        "model": "smollm2",
        "input": "Use the tool.",
        "tools": [remote(mcp_url, "hang")],
        "tool_choice": {"type": "mcp", "server_label": "remote", "name": "hang"},
        "stream": True,
    }
    before = cancelled_calls(url)
    traced[1].state.rebar.ping_interval_s = 0.2  # keep-alives find the client gone soon
    try:
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if "response.mcp_call.in_progress" in line:
                    break
        assert wait_until(lambda: cancelled_calls(url) == before + 1), (
            "the call outlived its client"
        )
    finally:
        traced[1].state.rebar.ping_interval_s = 10.0
    assert_idle(traced[1])


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"server_url": "http://169.254.169.254/mcp"}, "tools.0.server_url"),
        ({"server_label": "nowhere"}, "tools.0.server_label"),
        ({"server_label": STDIO, "require_approval": "always"}, "tools.0.require_approval"),
        ({"server_label": STDIO, "headers": {"a": "b"}}, "tools.0.headers"),
    ],
)
def test_servers_not_allowed_are_400s_naming_the_tool(traced, tool, param) -> None:
    body = {
        "model": "smollm2",
        "input": "hi",
        "tools": [{"type": "mcp", "server_label": "x", **tool}],
    }
    reply = httpx.post(traced[0] + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_an_allowed_server_that_is_down_is_a_424(served_models) -> None:
    from live_server import free_port
    from rebar.engine.async_engine import AsyncEngine
    from rebar.server.app import create_app

    dead = f"http://127.0.0.1:{free_port()}/mcp"
    settings = server_settings(**{"mcp.allowed_urls": [dead], "mcp.connect_timeout_s": 5})
    served_models.engine = AsyncEngine(served_models.chat.engine)
    with live_server(create_app(settings, served_models)) as url:
        tools = [{"type": "mcp", "server_label": "down", "server_url": dead}]
        body = {"model": "smollm2", "input": "hi", "tools": tools}
        reply = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 424, reply.text
    assert reply.json()["error"]["code"] == "mcp_server_unavailable"


def test_a_flow_is_traced_counted_and_logged(client, traced) -> None:
    from rebar.obs.logs import JsonFormatter, RequestContextFilter

    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestContextFilter())
    logger = logging.getLogger("rebar.agents")
    logger.addHandler(handler)
    saved = logger.level
    logger.setLevel(logging.INFO)
    try:
        # an input of its own: no cached turn, so each turn generates
        response = forced(client, local("fail"), "fail", input="Call the failing tool.")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
    assert items_of(response, "mcp_call")[0].status == "failed"
    (line,) = [json.loads(text) for text in buffer.getvalue().splitlines()]
    assert line["request_id"] and line["outcome"] == "error" and line["rebar.mcp.tool"] == "fail"
    spans = traced[2].get_finished_spans()
    by_id = {span.context.span_id: span for span in spans}
    call = [s for s in spans if s.name == "tool call" and s.attributes["rebar.mcp.tool"] == "fail"][
        -1
    ]
    flow = by_id[call.parent.span_id]  # calls run between turns, under the flow
    turns = [s for s in spans if s.parent is not None and s.parent.span_id == flow.context.span_id]
    assert flow.name == "flow" and {s.name for s in turns} == {"model turn", "tool call"}
    turn = next(s for s in turns if s.name == "model turn")
    assert any(s.name == "generate" and s.parent.span_id == turn.context.span_id for s in spans)
    assert flow.attributes["rebar.flow.tool_calls"] == 1
    assert call.attributes["rebar.mcp.outcome"] == "error"
    metrics = httpx.get(traced[0] + "/metrics", timeout=30).text
    assert f'rebar_tool_calls_total{{outcome="error",server="{STDIO}"}}' in metrics
    assert "rebar_tool_call_duration_seconds_count" in metrics


def test_the_loops_time_limit_ends_it_incomplete_and_cancels_its_call(served_models, mcp_url):
    from rebar.engine.async_engine import AsyncEngine
    from rebar.server.app import create_app

    limits = {"mcp.allowed_urls": [mcp_url], "mcp.flow_timeout_s": 3}
    settings = server_settings(**limits)
    served_models.engine = AsyncEngine(served_models.chat.engine)
    app = create_app(settings, served_models)
    with live_server(app) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as sdk:
            response = forced(sdk, remote(mcp_url, "hang"), "hang", input="Wait for it.")
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "flow_time_limit"
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'rebar_tool_calls_total{outcome="cancelled",server="remote"} 1.0' in metrics
        assert 'rebar_tool_flows_total{status="incomplete"} 1.0' in metrics
        assert_idle(app)
