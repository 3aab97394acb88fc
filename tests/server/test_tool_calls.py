"""Reading tool calls out of answers (rebar.server.pipeline.tool_calls) for each family's format, whole and
streamed: every way of cutting a stream gives the whole answer's calls and text, and text that
only looks like a call is never lost."""

from __future__ import annotations

import itertools
import json

import pytest

from rebar.server.pipeline.tool_call_stream import CallPiece, ToolCallStream
from rebar.server.pipeline.tool_calls import ParsedCall, ToolCallReader

NAMES = ("get_weather", "add")
HERMES_TWO = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)
WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
ADD = ParsedCall("add", '{"a": 1, "b": 2}')


def streamed(
    reader: ToolCallReader, pieces: list[str]
) -> tuple[str, list[ParsedCall], list[CallPiece]]:
    """(content, calls, tool-call pieces) of an answer fed in `pieces`."""
    stream = ToolCallStream(reader)
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
    content = "".join(e.content for e in events)
    deltas = [e.tool_call for e in events if e.tool_call is not None]
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
        if delta.name is not None:
            assert not call["name"], "a name is sent once, first"
            assert delta.id is not None and delta.id.startswith("call_")
            call["name"] = delta.name
        else:
            assert delta.id is None, "only a call's first piece has its id"
        call["arguments"] += delta.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [ParsedCall(c["name"], c["arguments"]) for c in calls.values()], deltas


def cuts(text: str, pieces: int) -> list[list[str]]:
    """Every way of cutting `text` into `pieces` pieces (first positions sampled for speed)."""
    positions = range(1, len(text))
    return [
        [text[a:b] for a, b in zip((0, *cut), (*cut, len(text)))]
        for cut in itertools.islice(itertools.combinations(positions, pieces - 1), 0, None, 7)
    ]


def same_call(a: ParsedCall, b: ParsedCall) -> bool:
    return a.name == b.name and json.loads(a.arguments) == json.loads(b.arguments)


def test_hermes_blocks_become_calls_and_the_rest_stays_text() -> None:
    answer = ToolCallReader("hermes", NAMES).parse(HERMES_TWO)
    assert answer.content == "Let me check."
    assert answer.calls == (WEATHER, ADD)


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_a_hermes_stream_cut_anywhere_gives_the_whole_answer(pieces) -> None:
    reader = ToolCallReader("hermes", NAMES)
    for cut in cuts(HERMES_TWO, pieces):
        content, calls, _deltas = streamed(reader, cut)
        assert content == "Let me check.\n", cut
        assert len(calls) == 2 and all(map(same_call, calls, (WEATHER, ADD))), cut


@pytest.mark.parametrize("pieces", [2, 3])
def test_forced_calls_stream_their_arguments_while_written(pieces) -> None:
    reader = ToolCallReader("hermes", NAMES, forced=True)
    text = HERMES_TWO[len("Let me check.\n") :]
    for cut in cuts(text, pieces):
        content, calls, _deltas = streamed(reader, cut)
        assert content == "" and all(map(same_call, calls, (WEATHER, ADD))), cut
    stream = ToolCallStream(reader)
    first = stream.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert [(e.tool_call.name, e.tool_call.arguments) for e in first if e.tool_call] == [
        ("add", ""),
        (None, '{"a": 1'),  # before the object is even complete
    ]


@pytest.mark.parametrize("forced", [False, True])
def test_hermes_arguments_stream_in_fragments_after_the_name(forced) -> None:
    reader = ToolCallReader("hermes", NAMES, forced=forced)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _, _calls, deltas = streamed(reader, [text[i : i + 3] for i in range(0, len(text), 3)])
    assert deltas[0].name == "get_weather" and deltas[0].arguments == ""
    fragments = [d.arguments for d in deltas[1:]]
    assert len(fragments) > 3 and "".join(fragments) == '{"city": "Paris"}'


@pytest.mark.parametrize(
    "text",
    [
        'Use <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call> like so',
        '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',
        "<tool_call> not json at all </tool_call> and more",
        'An unfinished <tool_call>\n{"name": "add", "argu',
        "Plain answer with a < sign and <tool_ in it",
    ],
)
def test_call_looking_text_that_is_not_a_call_is_kept_whole(text) -> None:
    reader = ToolCallReader("hermes", NAMES)
    assert reader.parse(text).calls == ()
    assert reader.parse(text).content == text
    for cut in [*cuts(text, 2), [text]]:
        content, calls, _ = streamed(reader, cut)
        if calls:  # only an unfinished known call may have gone out (its name was complete)
            assert text.startswith("An unfinished")
            continue
        assert content == text, cut


def test_arguments_written_as_a_json_string_are_read() -> None:
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert ToolCallReader("hermes", NAMES).parse(text).calls == (ADD,)


def test_without_parallel_calls_only_the_first_is_a_call() -> None:
    reader = ToolCallReader("hermes", NAMES, parallel=False)
    answer = reader.parse(HERMES_TWO)
    assert answer.calls == (WEATHER,)
    assert '"name": "add"' in answer.content  # the second stays as text, not dropped
    content, calls, _ = streamed(reader, [HERMES_TWO])
    assert len(calls) == 1 and '"name": "add"' in content


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '  {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", '
        '"parameters": {"a": 1, "b": 2}}',
    ],
)
def test_llama3_json_answers_are_calls(text) -> None:
    reader = ToolCallReader("llama3_json", NAMES)
    answer = reader.parse(text)
    assert answer.content == "" and answer.calls[0] == WEATHER
    for cut in [*cuts(text, 2)[:40], [text]]:
        content, calls, _ = streamed(reader, cut)
        assert content == "" and [c.name for c in calls] == [c.name for c in answer.calls]


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny in Paris.",
        '{"name": "get_weather"}',  # no parameters: an answer that happens to be JSON
        '{"temperature": 21}',
    ],
)
def test_llama3_json_text_answers_stay_text(text) -> None:
    reader = ToolCallReader("llama3_json", NAMES)
    assert reader.parse(text).calls == () and reader.parse(text).content == text
    for cut in cuts(text, 2)[:40]:
        assert streamed(reader, cut)[:2] == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
    ],
)
def test_mistral_calls_in_both_spellings(text) -> None:
    reader = ToolCallReader("mistral", NAMES)
    assert reader.parse(text).calls == (WEATHER, ADD)
    for cut in cuts(text, 2)[:40]:
        content, calls, _ = streamed(reader, cut)
        assert content == "" and all(map(same_call, calls, (WEATHER, ADD)))


def test_without_parallel_calls_a_whole_answer_keeps_its_other_calls_as_text() -> None:
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ' + (
        '{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    )
    answer = ToolCallReader("mistral", NAMES, parallel=False).parse(text)
    assert answer.calls == (WEATHER,)
    assert json.loads(answer.content) == [{"name": "add", "arguments": {"a": 1, "b": 2}}]


def test_mistral_text_answers_stream_as_they_come() -> None:
    reader = ToolCallReader("mistral", NAMES)
    stream = ToolCallStream(reader)
    assert [e.content for e in stream.feed("It is")] == ["It is"]  # not held: cannot be a call
    assert reader.parse("[TOOL_CALLS] broken").calls == ()


# ----- the chat renderer's chunks -------------------------------------------------------------------


def chunks_of(text_pieces: list[str], reader: ToolCallReader) -> list[dict]:
    from types import SimpleNamespace

    from rebar.engine.outputs import RequestOutput
    from rebar.server.dialects.openai_chat import ChatRenderer
    from rebar.server.pipeline.answer import AnswerReader
    from rebar.server.pipeline.respond import ResponseInfo

    answers = AnswerReader(SimpleNamespace(), False, None, reader)
    render = ChatRenderer(ResponseInfo("1", "m", "m-v1", 0, 1, False, False))
    events = []
    for i, piece in enumerate(text_pieces):
        last = i == len(text_pieces) - 1
        output = RequestOutput("r", 0, (1,), piece, last, "stop" if last else None)
        events += list(render.stream_item(answers.events(output)))
    return [json.loads(e[6:])["choices"][0] for e in events if e.startswith("data: {")]


def test_a_stream_keeps_text_and_calls_in_the_answers_order() -> None:
    text = (
        'Checking.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        " Then I will add more."
    )
    choices = chunks_of([text], ToolCallReader("hermes", NAMES))
    order = [
        "call" if c["delta"].get("tool_calls") else c["delta"].get("content")
        for c in choices
        if c["finish_reason"] is None
    ]
    assert order[0] == "Checking." and order[-1] == " Then I will add more."
    assert set(order[1:-1]) == {"call"}
    assert choices[-1]["finish_reason"] == "tool_calls"
