"""The agent-flow example (examples/agent_flow) as a user runs it: the OpenAI Agents SDK against a
live rebar whose configured MCP server is the example's own library server (stdio, offline)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

from live_server import assert_idle, live_server, server_settings
from needs import need_module

need_module("agents")
need_module("mcp")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent_flow"


def test_the_four_step_flow_runs_with_its_parallel_branch(served_models) -> None:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import flow  # examples/agent_flow/flow.py
    finally:
        sys.path.remove(str(EXAMPLE))
    from rebar.engine.async_engine import AsyncEngine
    from rebar.server.app import create_app

    library = {
        "label": "library",
        "command": sys.executable,
        "args": [str(EXAMPLE / "library_server.py"), str(EXAMPLE / "library")],
        "allowed_tools": ["search", "format_report"],
    }
    settings = server_settings(**{"mcp.servers": [library]})
    served_models.engine = AsyncEngine(served_models.chat.engine)
    app = create_app(settings, served_models)
    with live_server(app, settings=settings) as url:
        result = asyncio.run(flow.run_flow(url))
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert_idle(app)
    assert list(result.steps) == ["search", "keywords", "summarise", "translate", "format"]
    (found,) = result.steps["search"].tool_outputs
    assert "[fresnel.txt]" in found  # the library server searched its folder
    assert result.steps["format"].tool_outputs[0].startswith("# ")  # format_report's Markdown
    assert all(step.ended_s > step.started_s for step in result.steps.values())
    search, keywords = result.steps["search"], result.steps["keywords"]
    assert keywords.started_s < search.ended_s and search.started_s < keywords.ended_s
    assert 'rebar_tool_calls_total{outcome="ok",server="library"} 2.0' in metrics
