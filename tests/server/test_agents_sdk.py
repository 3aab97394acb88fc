"""The OpenAI Agents SDK against a live rebar: `Runner.run` of an agent with a function tool, on the
SDK's Responses model class, to completion — the model's call runs the tool, its output goes back
through `/v1/responses`, and the agent answers."""

from __future__ import annotations

import asyncio

import pytest

from needs import need_module

agents = need_module("agents")
openai = need_module("openai")


def test_an_agent_calls_its_tool_and_finishes(server) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # nothing is sent to OpenAI's trace exporter
    url, _ = server
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is 21 C and sunny in {city}."

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer questions about the weather.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model="smollm2", openai_client=client),
            # The first turn must call the tool; the SDK then resets the choice to auto.
            # One call (with parallel calls allowed this small model keeps writing more).
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=300
            ),
        )
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    assert cities and all(isinstance(city, str) and city for city in cities)
    assert kinds.index(ToolCallOutputItem) > kinds.index(ToolCallItem)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert isinstance(result.new_items[-1], MessageOutputItem)
    assert result.context_wrapper.usage.requests >= 2


@pytest.fixture(scope="module", autouse=True)
def _quiet_agents_logs():
    """The SDK logs every turn at INFO; keep failures readable."""
    import logging

    logging.getLogger("openai.agents").setLevel(logging.WARNING)
    yield
