"""Reasoning and tool calls on the chat page: a collapsed reasoning block above the answer's text, a
block per tool call below it, and neither for an ordinary answer.

SmolLM2 does not think, so the answer with reasoning is a scripted stream (Playwright fulfils the
page's chat request with it). The streamed tool call is SmolLM2's own: the test adds a tool to the
page's request on its way to the server, as a user who configured tools would.
"""

from __future__ import annotations

import itertools
import json

import pytest
from chat_page_driver import GENERATION_TIMEOUT_MS, expect, open_page
from web_tools import SCREENSHOT_DIR

from live_server import server_settings, serving_models
from suite_tiers import limit

pytestmark = limit("browser")  # tests/suite_tiers.py

CHAT_ROUTE = "**/v1/chat/completions"
REASONING = "The user asks two things.\nI need the weather tool and the adder. <b>not bold</b>"
WEATHER_ARGUMENTS = {"city": "Paris", "unit": "celsius"}
ADD_ARGUMENTS = {"a": 2, "b": 3}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def chat_server(served_models):
    with serving_models(served_models, server_settings()) as (url, app):
        yield url, app


@pytest.fixture
def chat(chromium_browser, chat_server):
    url, _app = chat_server
    with open_page(chromium_browser, url) as page:
        page.wait_for_model()
        yield page


def sse_stream(deltas: list[dict], finish_reason: str) -> str:
    """A chat completion stream as rebar sends it: the opening chunk, one chunk per delta, the
    final chunk, usage, [DONE]."""

    def chunk(choices: list[dict], **extra) -> str:
        body = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0}
        return f"data: {json.dumps({**body, 'model': 'smollm2', 'choices': choices, **extra})}\n\n"

    def choice(delta: dict, finish: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    events = [
        chunk([choice({"role": "assistant", "content": ""})]),
        *(chunk([choice(delta)]) for delta in deltas),
        chunk([choice({}, finish_reason)]),
        chunk([], usage={"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}),
    ]
    return "".join(events) + "data: [DONE]\n\n"


def tool_call_deltas(index: int, call_id: str, name: str, arguments: dict) -> list[dict]:
    """OpenAI's deltas of one call: id and name first, then the arguments in three fragments."""
    text = json.dumps(arguments, separators=(",", ":"))
    cuts = [0, len(text) // 3, 2 * len(text) // 3, len(text)]
    first = {"index": index, "id": call_id, "type": "function"}
    return [
        {"tool_calls": [{**first, "function": {"name": name, "arguments": ""}}]},
        *(
            {"tool_calls": [{"index": index, "function": {"arguments": text[a:b]}}]}
            for a, b in itertools.pairwise(cuts)
        ),
    ]


SCRIPTED_ANSWER = sse_stream(
    [
        {"reasoning_content": REASONING[:20]},
        {"reasoning_content": REASONING[20:]},
        {"content": "Let me check."},
        *tool_call_deltas(0, "call_weather", "get_weather", WEATHER_ARGUMENTS),
        *tool_call_deltas(1, "call_add", "add", ADD_ARGUMENTS),
    ],
    "tool_calls",
)


def visible_parts(answer) -> list[str]:
    """The classes of the answer's parts on screen, top to bottom."""
    return answer.evaluate("el => [...el.children].filter(c => !c.hidden).map(c => c.className)")


def expect_reasoning_and_calls(answer) -> None:
    assert visible_parts(answer) == ["speaker", "reasoning", "content", "tool-calls", "note"]
    reasoning = answer.locator("details.reasoning")
    expect(reasoning).to_have_js_property("open", False)
    expect(reasoning.locator("summary")).to_have_text("Reasoning")
    expect(reasoning.locator(".reasoning-text")).to_be_hidden()
    expect(reasoning.locator(".reasoning-text")).to_have_text(REASONING)
    assert reasoning.locator("b").count() == 0  # model text stays text
    expect(answer.locator(".content")).to_have_text("Let me check.")

    calls = answer.locator(".tool-call")
    expect(calls.locator(".tool-name")).to_have_text(["get_weather", "add"])
    expect(calls.locator(".tool-arguments")).to_have_text(
        [json.dumps(WEATHER_ARGUMENTS, indent=2), json.dumps(ADD_ARGUMENTS, indent=2)]
    )
    expect(calls.first).to_contain_text("Tool call get_weather")


def test_reasoning_is_collapsed_above_the_answer_and_tool_calls_are_shown_below_it(chat) -> None:
    chat.page.route(
        CHAT_ROUTE,
        lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=SCRIPTED_ANSWER
        ),
        times=1,
    )
    chat.send("What is the weather in Paris, and what is 2 + 3?")
    answer = chat.last_answer()
    expect(answer.locator(".note")).to_contain_text("12 tokens")
    expect_reasoning_and_calls(answer)

    reasoning = answer.locator("details.reasoning")
    reasoning.locator("summary").click()
    expect(reasoning).to_have_js_property("open", True)
    expect(reasoning.locator(".reasoning-text")).to_be_visible()
    assert chat.page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    chat.page.screenshot(path=str(SCREENSHOT_DIR / "chat-reasoning-and-tools.png"), full_page=True)

    # Kept across a reload, collapsed again.
    chat.page.reload()
    chat.wait_for_model()
    expect_reasoning_and_calls(chat.last_answer())

    # The next answer is SmolLM2's own, from the server: text only, no empty blocks.
    chat.settings(max_tokens=8)
    chat.send("Say hello.")
    ordinary = chat.answers().nth(1)
    expect(ordinary.locator(".note")).to_contain_text("tokens", timeout=GENERATION_TIMEOUT_MS)
    assert ordinary.locator(".content").inner_text().strip()
    assert visible_parts(ordinary) == ["speaker", "content", "note"]
    expect(ordinary.locator(".reasoning")).to_be_hidden()
    expect(ordinary.locator(".tool-calls")).to_be_hidden()
    assert ordinary.locator(".tool-call").count() == 0


def test_a_tool_call_streamed_by_the_server_grows_into_its_block(chat) -> None:
    def with_a_tool(route) -> None:
        body = json.loads(route.request.post_data)
        tools = {"tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False}
        route.continue_(post_data=json.dumps({**body, **tools}))

    chat.page.route(CHAT_ROUTE, with_a_tool, times=1)
    chat.settings(max_tokens=80, temperature=0)
    chat.page.evaluate(
        """() => {
            window.argumentTexts = [];
            new MutationObserver(() => {
                const shown = document.querySelector("article.turn.assistant .tool-arguments");
                if (shown) window.argumentTexts.push(shown.textContent);
            }).observe(document.getElementById("conversation"),
                       { childList: true, subtree: true, characterData: true });
        }"""
    )
    chat.send("What is the weather in Oslo?")
    answer = chat.last_answer()
    expect(answer.locator(".note")).to_contain_text("tokens", timeout=GENERATION_TIMEOUT_MS)
    expect(answer.locator(".tool-name")).to_have_text("get_weather")
    shown = answer.locator(".tool-arguments").inner_text()
    arguments = json.loads(shown)
    assert set(arguments) == {"city", "unit"}
    assert shown == json.dumps(arguments, indent=2, ensure_ascii=False)  # pretty-printed
    assert visible_parts(answer) == ["speaker", "content", "tool-calls", "note"]
    assert not answer.locator(".content").inner_text()

    grew = list(dict.fromkeys(chat.page.evaluate("() => window.argumentTexts")))
    assert len(grew) >= 3, f"the arguments did not arrive in pieces: {grew}"
    assert grew[-1] == shown
