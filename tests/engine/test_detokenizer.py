"""Incremental detokenization on the real SmolLM2 byte-level BPE: UTF-8 safety and stop strings."""

from __future__ import annotations

import inspect
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rebar.engine.detokenizer import IncrementalDetokenizer, _partial_stop_length

TEXTS = [
    "Hello, world! This is plain English.",
    "日本語のテキストです。東京は大きい。",
    "Emoji 🎉🚀 and accents: déjà vu, naïve café, Ærøskøbing.",
    "def f(x):\n\treturn x ** 2  # 平方\n",
]


def stream(
    tokenizer, ids: list[int], stop: tuple[str, ...] = ()
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for token in ids:
        deltas.append(detok.add(token))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_never_splits_characters(
    smollm2_tokenizer, text: str
) -> None:
    ids = smollm2_tokenizer.encode(text)
    deltas, _ = stream(smollm2_tokenizer, ids)
    assert "".join(deltas) == smollm2_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_tokens_are_held_until_complete(smollm2_tokenizer) -> None:
    ids = smollm2_tokenizer.encode("🎉")
    assert len(ids) > 1, (
        "the emoji must span several byte-level tokens for this test to mean anything"
    )
    deltas, _ = stream(smollm2_tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1)
    assert "".join(deltas) == "🎉"


def test_stop_string_is_cut_and_its_prefix_never_leaks(smollm2_tokenizer) -> None:
    text = "The answer is 42.\nUser: next question"
    ids = smollm2_tokenizer.encode(text)
    deltas, detok = stream(smollm2_tokenizer, ids, stop=("\nUser:",))
    assert "".join(deltas) == "The answer is 42."
    assert detok.stop_string == "\nUser:"
    assert not any(d.endswith("\n") for d in deltas[:-1]), (
        "the stop string's beginning leaked early"
    )


def test_held_back_prefix_is_released_when_it_does_not_complete(smollm2_tokenizer) -> None:
    text = "a\nUse the force"
    deltas, detok = stream(smollm2_tokenizer, smollm2_tokenizer.encode(text), stop=("\nUser:",))
    assert "".join(deltas) == text
    assert not detok.stopped


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer) -> None:
    deltas, detok = stream(
        smollm2_tokenizer, smollm2_tokenizer.encode("one two three four"), stop=("four", "two")
    )
    assert "".join(deltas) == "one "
    assert detok.stop_string == "two"


def test_partial_stop_length() -> None:
    assert _partial_stop_length("abc\nUs", ["\nUser:"]) == 3
    assert _partial_stop_length("abc", ["\nUser:"]) == 0
    assert _partial_stop_length("x#", ["##", "#!"]) == 1


# --- stop strings at scale, against their definition ----------------------------------------------


class PieceTokenizer:
    """Token i decodes to PIECES[i]: whole characters only, so the text is the pieces joined."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def naive_partial_stop_length(text: str, stops: list[str]) -> int:
    """The definition: the longest suffix of `text` that is a proper prefix of a stop string."""
    return max(
        (n for stop in stops for n in range(len(stop)) if text.endswith(stop[:n])), default=0
    )


def reference_stream(pieces: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    """What the stream must show: each piece's final text, cut before the earliest stop string."""
    text, emitted, deltas = "", 0, []
    for piece in pieces:
        text += piece
        hits = [(text.find(stop), order) for order, stop in enumerate(stops) if stop in text]
        if hits:
            index, order = min(hits)
            deltas.append(text[emitted:index])
            return deltas, stops[order]
        end = len(text) - naive_partial_stop_length(text, stops)
        deltas.append(text[emitted:end])
        emitted = end
    return [*deltas, text[emitted:]], None


small_stops = st.lists(st.text(alphabet="ab", min_size=1, max_size=6), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=16),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6), max_size=3),
)
def test_partial_stop_length_is_the_longest_suffix_that_is_a_proper_prefix(
    text: str, stops: list[str]
) -> None:
    assert _partial_stop_length(text, stops) == naive_partial_stop_length(text, stops)


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.text(alphabet="ab", max_size=3), max_size=12), stops=small_stops)
def test_streamed_text_and_stop_match_the_definition(pieces: list[str], stops: list[str]) -> None:
    detok = IncrementalDetokenizer(PieceTokenizer(pieces), stops)
    deltas = []
    for token_id in range(len(pieces)):
        deltas.append(detok.add(token_id))
        if detok.stopped:
            break
    if not detok.stopped:
        deltas.append(detok.finish())
    assert (deltas, detok.stop_string) == reference_stream(pieces, stops)


def count_detokenizer_lines(work, limit: int) -> int:
    """Lines of detokenizer.py that `work()` executes; fails as soon as they pass `limit`."""
    module_file = inspect.getsourcefile(IncrementalDetokenizer)
    count = 0

    def on_line(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > limit:
                raise AssertionError(f"the detokenizer ran more than {limit} lines")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == module_file else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        work()
    finally:
        sys.settrace(previous)
    return count


def test_long_stop_strings_cost_time_in_the_new_text_not_in_their_length() -> None:
    """16 stops of 60,000 characters over 1,000 tokens: the stop work per token follows the new
    characters (a few lines per character and stop), so it cannot stall the engine thread."""
    pieces = [
        " w" + str(i % 97) for i in range(1000)
    ]  # about 4 characters a token, never a stop prefix
    stops = [f"{i:02d}" + "x" * 59_998 for i in range(16)] + [
        "w1 w2 w3 w4x"
    ]  # and one that almost matches
    detok = IncrementalDetokenizer(
        PieceTokenizer(pieces), stops
    )  # building the automata is not counted
    num_chars = sum(map(len, pieces))

    def stream_all() -> None:
        for token_id in range(len(pieces)):
            detok.add(token_id)

    lines = count_detokenizer_lines(
        stream_all, limit=10 * num_chars * len(stops) + 60 * len(pieces)
    )
    assert not detok.stopped and detok.num_released_chars == num_chars
    assert lines > num_chars * len(stops)  # the count does see the per-character work
