"""Incremental detokenization on the real SmolLM2 byte-level BPE: UTF-8 safety and stop strings."""

from __future__ import annotations

import pytest

from rebar.engine.detokenizer import IncrementalDetokenizer, _partial_stop_length

TEXTS = [
    "Hello, world! This is plain English.",
    "日本語のテキストです。東京は大きい。",
    "Emoji 🎉🚀 and accents: déjà vu, naïve café, Ærøskøbing.",
    "def f(x):\n\treturn x ** 2  # 平方\n",
]


def stream(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for token in ids:
        deltas.append(detok.add(token))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_never_splits_characters(smollm2_tokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    deltas, _ = stream(smollm2_tokenizer, ids)
    assert "".join(deltas) == smollm2_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_tokens_are_held_until_complete(smollm2_tokenizer) -> None:
    ids = smollm2_tokenizer.encode("🎉")
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test to mean anything"
    deltas, _ = stream(smollm2_tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1)
    assert "".join(deltas) == "🎉"


def test_stop_string_is_cut_and_its_prefix_never_leaks(smollm2_tokenizer) -> None:
    text = "The answer is 42.\nUser: next question"
    ids = smollm2_tokenizer.encode(text)
    deltas, detok = stream(smollm2_tokenizer, ids, stop=("\nUser:",))
    assert "".join(deltas) == "The answer is 42."
    assert detok.stop_string == "\nUser:"
    assert not any(d.endswith("\n") for d in deltas[:-1]), "the stop string's beginning leaked early"


def test_held_back_prefix_is_released_when_it_does_not_complete(smollm2_tokenizer) -> None:
    text = "a\nUse the force"
    deltas, detok = stream(smollm2_tokenizer, smollm2_tokenizer.encode(text), stop=("\nUser:",))
    assert "".join(deltas) == text
    assert not detok.stopped


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer) -> None:
    deltas, detok = stream(smollm2_tokenizer, smollm2_tokenizer.encode("one two three four"), stop=("four", "two"))
    assert "".join(deltas) == "one "
    assert detok.stop_string == "two"


def test_partial_stop_length() -> None:
    assert _partial_stop_length("abc\nUs", ["\nUser:"]) == 3
    assert _partial_stop_length("abc", ["\nUser:"]) == 0
    assert _partial_stop_length("x#", ["##", "#!"]) == 1
