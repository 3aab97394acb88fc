"""A four-step flow with the OpenAI Agents SDK against a live rebar: search the example's library
(an MCP tool rebar runs), summarise what was found, translate the summary into French, and format
a report (another MCP tool); a second, independent branch (keywords for the question) runs beside
the search, both on the engine at once.

    rebar serve --config examples/agent_flow/rebar.toml    # in one terminal
    python examples/agent_flow/flow.py --base-url http://127.0.0.1:8000

Each step prints when it ran (seconds from the start), so the overlap of the parallel branches
shows; `/metrics` counts the tool calls.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field

import httpx
from agents import Agent, HostedMCPTool, ModelSettings, Runner, set_tracing_disabled
from agents.model_settings import MCPToolChoice
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

LIBRARY = "library"  # the label of the MCP server rebar runs (rebar.toml)
MAX_TOKENS = 160  # per model turn: room for a short answer from a small model
QUESTION = "How does a lighthouse lens make its beam visible far out at sea?"


class Short(BaseModel):
    """Every step answers in this shape: a bounded text, so even a small model that would ramble
    ends its answer (rebar holds the output to the schema by grammar)."""

    text: str = Field(max_length=240)


@dataclass
class Step:
    """One step: what it answered, what its MCP calls returned, when it ran."""

    name: str
    started_s: float
    ended_s: float
    answer: str
    tool_outputs: list[str] = field(default_factory=list)


@dataclass
class FlowResult:
    steps: dict[str, Step]
    max_batch: int = 0  # most requests in the engine's running batch during the parallel branches

    @property
    def parallel_overlap_s(self) -> float:
        """Seconds the search and keywords branches ran at the same time."""
        a, b = self.steps["search"], self.steps["keywords"]
        return max(0.0, min(a.ended_s, b.ended_s) - max(a.started_s, b.started_s))


def make_agent(
    name: str, instructions: str, model: OpenAIResponsesModel, tool: str | None = None
) -> Agent:
    """An agent of one step; with `tool`, its first turn must call that tool of the library."""
    tools, settings = [], ModelSettings(temperature=0, max_tokens=MAX_TOKENS)
    if tool is not None:
        config = {"type": "mcp", "server_label": LIBRARY, "allowed_tools": [tool]}
        tools = [HostedMCPTool(tool_config={**config, "require_approval": "never"})]
        settings = ModelSettings(
            temperature=0,
            max_tokens=MAX_TOKENS,
            tool_choice=MCPToolChoice(server_label=LIBRARY, name=tool),
            extra_body={"max_tool_calls": 1},
        )
    return Agent(
        name=name,
        instructions=instructions,
        model=model,
        tools=tools,
        model_settings=settings,
        output_type=Short,
    )


async def run_step(name: str, agent: Agent, text: str, start: float) -> Step:
    started = time.monotonic() - start
    result = await Runner.run(agent, text, max_turns=2)
    outputs = [
        item.output or f"error: {item.error}"
        for response in result.raw_responses
        for item in response.output
        if item.type == "mcp_call"
    ]
    answer = result.final_output.text if isinstance(result.final_output, Short) else ""
    return Step(name, started, time.monotonic() - start, answer, outputs)


@dataclass
class BatchWatch:
    """Samples rebar's `rebar_requests_running` gauge (the engine's running batch) until
    cancelled; `most` is the largest value seen."""

    base_url: str
    api_key: str
    most: int = 0

    async def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=10) as http:
            while True:
                for line in (await http.get("/metrics")).text.splitlines():
                    if line.startswith("rebar_requests_running{"):
                        self.most = max(self.most, int(float(line.split()[-1])))
                await asyncio.sleep(0.05)


async def run_flow(base_url: str, question: str = QUESTION, api_key: str = "unused") -> FlowResult:
    set_tracing_disabled(True)  # offline: no traces sent to OpenAI
    client = AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0)
    model = OpenAIResponsesModel(model="smollm2", openai_client=client)
    searcher = make_agent("search", "Search the library for the question.", model, "search")
    keywords = make_agent("keywords", "Give three keywords for the question.", model)
    start = time.monotonic()
    watch = BatchWatch(base_url, api_key)
    watching = asyncio.create_task(watch.run())
    search, words = await asyncio.gather(
        run_step("search", searcher, question, start),
        run_step("keywords", keywords, question, start),
    )
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    found = "\n".join(search.tool_outputs) or search.answer
    summariser = make_agent("summarise", "Summarise the passages in two sentences.", model)
    summary = await run_step("summarise", summariser, found, start)
    translator = make_agent("translate", "Translate the text into French.", model)
    french = await run_step("translate", translator, summary.answer, start)
    formatter = make_agent("format", "Write the report.", model, "format_report")
    report_input = f"Title: {question}\nSummary: {summary.answer}\nFrench: {french.answer}"
    report = await run_step("format", formatter, report_input, start)
    await client.close()
    steps = [search, words, summary, french, report]
    return FlowResult({step.name: step for step in steps}, watch.most)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args()
    key = os.environ.get("REBAR_API_KEY", "unused")
    result = asyncio.run(run_flow(args.base_url, args.question, key))
    for step in result.steps.values():
        print(f"[{step.started_s:6.2f}s - {step.ended_s:6.2f}s] {step.name}")
        for output in step.tool_outputs:
            print(f"    tool: {output[:200]}")
        print(f"    answer: {step.answer[:200]}")
    print(f"search and keywords overlapped for {result.parallel_overlap_s:.2f} s")
    print(f"the engine ran up to {result.max_batch} requests in one batch meanwhile")


if __name__ == "__main__":
    main()
