"""Sliding-window perplexity: every token scored once, and the numbers of an independent
computation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from needs import need_module
from rebar.errors import InvalidRequestError
from rebar.eval.perplexity import evaluation_tokens, perplexity, read_text, sliding_windows

VOCAB = 11


@pytest.mark.parametrize("num_tokens", [2, 3, 10, 17, 64, 65])
@pytest.mark.parametrize(
    ("context", "stride"), [(2, 1), (4, 3), (8, 2), (8, 7), (16, 5), (100, 99)]
)
def test_every_token_but_the_first_is_scored_once_with_history(
    num_tokens: int, context: int, stride: int
) -> None:
    windows = sliding_windows(num_tokens, context, stride)
    targets = [t for w in windows for t in range(w.first_target, w.end)]
    assert targets == list(range(1, num_tokens))
    for index, window in enumerate(windows):
        assert 0 <= window.begin < window.first_target <= window.end <= num_tokens
        assert window.end - window.begin == min(context, num_tokens)
        if (
            index > 0
        ):  # later windows: at least context - stride tokens of history before the first target
            assert window.first_target - window.begin >= context - stride
            assert window.end - window.first_target <= stride


@pytest.mark.parametrize(
    ("context", "stride", "tokens", "param"),
    [(1, 1, 10, "context"), (8, 8, 10, "stride"), (8, 0, 10, "stride"), (8, 4, 1, "data")],
)
def test_bad_settings_are_named(context: int, stride: int, tokens: int, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        sliding_windows(tokens, context, stride)
    assert info.value.param == param


def bigram_logits(table: torch.Tensor):
    """A model whose prediction depends only on the current token: windowing cannot change its loss."""
    calls = []

    def logits_of(ids: list[int]) -> torch.Tensor:
        calls.append(len(ids))
        return table[torch.tensor(ids)]

    return logits_of, calls


@pytest.mark.parametrize(("context", "stride"), [(5, 4), (8, 3), (64, 63)])
def test_equals_full_sequence_cross_entropy_for_a_bigram_model(context: int, stride: int) -> None:
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, generator=generator)
    ids = torch.randint(0, VOCAB, (50,), generator=generator).tolist()
    logits_of, calls = bigram_logits(table)
    result = perplexity(logits_of, ids, context, stride)
    expected_nll = F.cross_entropy(table[torch.tensor(ids[:-1])], torch.tensor(ids[1:])).item()
    assert result.num_scored == 49
    assert result.mean_nll == pytest.approx(expected_nll, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(expected_nll), rel=1e-6)
    assert result.num_windows == len(calls) and all(n == min(context, 50) for n in calls)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    need_module("transformers")
    import hf_tiny

    model = hf_tiny.build_decoder("LlamaForCausalLM", seed=3, num_key_value_heads=2)
    folder = hf_tiny.save_decoder(model, tmp_path_factory.mktemp("tiny-ppl"))
    return model, folder


def test_matches_transformers_loss_on_a_tiny_model(tiny_model) -> None:
    from rebar import LLM

    hf_model, folder = tiny_model
    llm = LLM(model=folder, device="cpu")
    ids = torch.randint(3, 160, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    result = perplexity(llm.logits, ids, context=64, stride=32)
    assert result.num_windows == 1
    assert result.mean_nll == pytest.approx(expected, rel=1e-4)
    windowed = perplexity(
        llm.logits, ids, context=16, stride=8
    )  # less history: a different, finite number
    assert (
        windowed.num_scored == 47
        and windowed.num_windows == 5
        and math.isfinite(windowed.perplexity)
    )


def test_reads_jsonl_and_plain_text(tmp_path: Path) -> None:
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(
        json.dumps({"text": "one"}) + "\nbroken\n" + json.dumps({"text": "two"}) + "\n",
        encoding="utf-8",
    )
    assert read_text(jsonl) == "one\n\ntwo"
    plain = tmp_path / "d.txt"
    plain.write_text("plain text", encoding="utf-8")
    assert read_text(plain) == "plain text"
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(InvalidRequestError, match="not UTF-8"):
        read_text(tmp_path / "bad.txt")
    with pytest.raises(InvalidRequestError, match="does not exist"):
        read_text(tmp_path / "absent.txt")


class WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


def test_evaluation_tokens_are_cut_to_max_tokens(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("a bb ccc dddd", encoding="utf-8")
    assert evaluation_tokens(WordTokenizer(), path) == [1, 2, 3, 4]
    assert evaluation_tokens(WordTokenizer(), path, max_tokens=2) == [1, 2]
    with pytest.raises(InvalidRequestError):
        evaluation_tokens(WordTokenizer(), path, max_tokens=1)
