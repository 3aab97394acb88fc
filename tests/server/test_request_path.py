"""One chat completion, traced through the code it runs: it goes down through each of the
pipeline's stages once and comes back up through each once, never returning to a stage it has
left.

The trace follows every function of the stage modules on the event loop's thread. A module's stay
lasts while any frame of it is alive, a coroutine's or a generator's from its first call to its
final return (suspended in between, it is still alive); two stays of one module mean the request
left it and came back. Code that reads data is not a visit: property getters and the methods
dataclasses generate (`__init__`, `__eq__`) are left out.
"""

from __future__ import annotations

import asyncio
import sys
from types import FrameType

import httpx
import pytest

from live_server import server_settings
from markers import requires_minilm, requires_smollm2

PIPELINE = "rebar.server.pipeline"
# The request's path: its dialect, the pipeline's entry, then the stages in order.
PATH = [
    "rebar.server.dialects.openai_chat",
    f"{PIPELINE}.respond",
    f"{PIPELINE}.lease",
    f"{PIPELINE}.prepare",
    f"{PIPELINE}.gate",
    f"{PIPELINE}.cache",
    f"{PIPELINE}.generate",
]


def _reads_data(frame: FrameType) -> bool:
    """A property getter, or a method a dataclass generated (its code has no file)."""
    code = frame.f_code
    if code.co_filename == "<string>":
        return True
    owner = frame.f_locals.get("self")
    return owner is not None and isinstance(getattr(type(owner), code.co_name, None), property)


def stays(events: list[tuple[str, object, str]]) -> dict[str, int]:
    """Stays per module from (event, frame, module) call/return events: the lifetimes of the
    module's frames (first call to last return), merged where they overlap."""
    first: dict[int, tuple[int, str]] = {}
    last: dict[int, int] = {}
    for i, (event, frame, module) in enumerate(events):
        if event == "call":
            first.setdefault(id(frame), (i, module))
        elif id(frame) in first:
            last[id(frame)] = i
    spans: dict[str, list[tuple[int, int]]] = {}
    for key, (start, module) in first.items():
        spans.setdefault(module, []).append((start, last.get(key, len(events))))
    counts = {}
    for module, intervals in spans.items():
        merged_end, count = -1, 0
        for start, end in sorted(intervals):
            if start > merged_end:
                count += 1
            merged_end = max(merged_end, end)
        counts[module] = count
    return counts


def test_a_module_left_and_entered_again_has_two_stays() -> None:
    a1, a2, b = object(), object(), object()
    events = [("call", a1, "a"), ("call", b, "b"), ("return", b, "b"), ("return", a1, "a")]
    assert stays(events) == {"a": 1, "b": 1}
    assert stays([*events, ("call", a2, "a"), ("return", a2, "a")])["a"] == 2


def traced(served_models, body: dict) -> tuple[int, list[str], dict[str, int]]:
    """(status, modules in the order the request entered them, stays of each)."""
    from rebar.server.app import create_app

    app = create_app(server_settings(**{"cache.enabled": False}), served_models)
    events: list[tuple[str, object, str]] = []
    watched = tuple(PATH)

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        module = frame.f_globals.get("__name__", "")
        if event not in ("call", "return") or not module.startswith(watched):
            return
        if event == "return" or not _reads_data(frame):
            events.append((event, frame, module))

    async def run() -> int:
        async with app.router.lifespan_context(app):
            while not app.state.rebar.registry.ready:
                await asyncio.sleep(0.05)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://rebar") as client:
                await client.post("/v1/chat/completions", json=body)  # warm every lazy path
                sys.setprofile(profile)
                try:
                    response = await client.post("/v1/chat/completions", json=body)
                    await response.aread()
                finally:
                    sys.setprofile(None)
                return response.status_code

    status = asyncio.run(run())
    order = list(dict.fromkeys(module for event, _, module in events if event == "call"))
    return status, order, stays(events)


def chat(**extra) -> dict:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS}], ids=["plain", "tools"])
@requires_smollm2
@requires_minilm
def test_a_chat_completion_passes_each_stage_once(served_models, extra) -> None:
    status, order, count = traced(served_models, chat(**extra))
    assert status == 200
    assert order == PATH
    assert all(count[module] == 1 for module in PATH), count


@requires_smollm2
@requires_minilm
def test_a_stream_sets_up_then_streams_through_the_stages(served_models) -> None:
    """A stream's body runs after the route has returned its response: each stage is visited at
    most twice, once to set the request up (an error still becomes a status code) and once while
    the body streams; the dialect renders each item."""
    status, order, count = traced(served_models, chat(stream=True))
    assert status == 200 and order == PATH
    assert {m: count[m] for m in PATH[1:] if count[m] > 2} == {}, count
