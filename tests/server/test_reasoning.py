"""Reasoning models: `<think>…</think>` told apart from the answer, whole and as it streams."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest

from rebar.engine.outputs import Choice, RequestOutput
from rebar.server.dialects.openai_chat import ChatRenderer
from rebar.server.pipeline.answer import AnswerReader
from rebar.server.pipeline.reasoning import ReasoningSplitter, split, thinking_start
from rebar.server.pipeline.respond import ResponseInfo
from rebar.server.pipeline.results import Completion

CASES = [
    # (output, whether the prompt opened the block) -> (reasoning, content)
    (
        "<think>\nParis is the capital.\n</think>\n\nParis.",
        False,
        ("\nParis is the capital.\n", "Paris."),
    ),
    ("  <think>hm</think>ok", False, ("hm", "ok")),
    ("It is Paris.", False, ("", "It is Paris.")),
    (
        "Tags like <think>x</think> in an answer stay text.",
        False,
        ("", "Tags like <think>x</think> in an answer stay text."),
    ),
    ("weighing options</think>\n\nParis.", True, ("weighing options", "Paris.")),
    ("still thinking when max_tokens hit", True, ("still thinking when max_tokens hit", "")),
    ("<think>cut short", False, ("cut short", "")),
    ("<thi", False, ("", "<thi")),  # ended before the tag could open: text after all
    ("", False, ("", "")),
]


@pytest.mark.parametrize(("text", "opened", "expected"), CASES)
def test_a_whole_answer_splits_into_reasoning_and_content(text, opened, expected) -> None:
    assert split(text, opened) == expected


@pytest.mark.parametrize(("text", "opened", "expected"), CASES)
def test_any_cut_of_the_stream_gives_the_whole_split(text, opened, expected) -> None:
    for cuts in itertools.combinations(range(1, len(text)), min(2, max(0, len(text) - 1))):
        pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
        splitter = ReasoningSplitter.for_prompt(opened)
        fed = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
        assert ("".join(r for r, _ in fed), "".join(c for _, c in fed)) == expected, pieces


def model_text(template: str, vocab: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(
        checkpoint=SimpleNamespace(chat_template=template),
        tokenizer=SimpleNamespace(
            token_to_id=vocab.get,
            decode=lambda ids, skip_special_tokens=False: "".join(f"<{i}>" for i in ids),
        ),
    )


def test_only_models_that_name_the_closing_tag_think() -> None:
    assert thinking_start(model_text("{{ messages }}", {}), [1, 2]) is None
    assert thinking_start(model_text("...</think>...", {}), [1, 2]) is False
    assert thinking_start(model_text("{{ messages }}", {"</think>": 7}), [1, 2]) is False
    opened = model_text("</think>", {})
    opened.tokenizer.decode = lambda ids, skip_special_tokens=False: "assistant\n<think>\n"
    assert thinking_start(opened, [1, 2]) is True


class Rendered:
    """A chat answer read by the pipeline and rendered by the chat dialect."""

    def __init__(self, thinking: bool | None) -> None:
        self.answers = AnswerReader(SimpleNamespace(), False, thinking)
        info = ResponseInfo("1", "m", "m-v1", 0, 1, False, thinking is not None)
        self.render = ChatRenderer(info)

    def json(self, completion: Completion) -> dict:
        return self.render.body(self.answers.read(completion))

    def output_chunks(self, output: RequestOutput) -> list[str]:
        return list(self.render.stream_item(self.answers.events(output)))

    def replay_chunks(self, choice: Choice) -> list[str]:
        return list(self.render.stream_item(self.answers.replay(choice)))


def renderer(thinking: bool | None) -> Rendered:
    return Rendered(thinking)


def deltas(events: list[str]) -> list[dict]:
    return [
        json.loads(e[6:])["choices"][0]["delta"]
        for e in events
        if e.startswith("data: {") and json.loads(e[6:])["choices"]
    ]


def output(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", 0, (1,), text, finished, "stop" if finished else None)


def test_a_stream_sends_reasoning_content_then_content() -> None:
    render = renderer(thinking=True)
    events = [
        e
        for o in (
            output("Let me"),
            output(" think.</th"),
            output("ink>\n\nParis"),
            output(".", True),
        )
        for e in render.output_chunks(o)
    ]
    sent = deltas(events)
    assert sent[:2] == [
        {"reasoning_content": "Let me", "reasoning": "Let me"},
        {"reasoning_content": " think.", "reasoning": " think."},
    ]
    assert sent[2:4] == [{"content": "Paris"}, {"content": "."}]
    assert sent[-1] == {}  # the final chunk


def test_whole_and_replayed_answers_carry_reasoning_content() -> None:
    choice = Choice(0, "<think>hm</think>\nParis.", [], "stop")
    completion = Completion((choice,), 5, 4)
    message = renderer(thinking=False).json(completion)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "Paris.",
        "reasoning_content": "hm",
        "reasoning": "hm",
    }
    assert deltas(list(renderer(False).replay_chunks(choice)))[0] == {
        "reasoning_content": "hm",
        "reasoning": "hm",
        "content": "Paris.",
    }


def test_a_model_that_does_not_think_is_rendered_as_before() -> None:
    choice = Choice(0, "<think>hm</think>\nParis.", [], "stop")
    message = renderer(thinking=None).json(Completion((choice,), 5, 4))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>hm</think>\nParis."}
    sent = deltas(list(renderer(None).output_chunks(output("<think>hm", True))))
    assert sent[0] == {"content": "<think>hm"}
