"""The bundled Gemma 3 270M (Q4_K_M GGUF) against llama.cpp: the same token ids for tricky strings,
and greedy continuations of the same prompt ids that follow llama.cpp's own server.

Fixtures come from `scripts/make_llamacpp_greedy_fixtures.py --model gemma3 --chat-template
'<start_of_turn>user\\n{}<end_of_turn>\\n<start_of_turn>model\\n'` (llama.cpp's `llama-server`,
built natively), run once on the file whose SHA-256 they record.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "gemma3_llamacpp_greedy.json").read_text("utf-8")
)


def test_fixtures_were_made_from_the_bundled_file(gemma3_tokenizer) -> None:
    from rebar.model import resolve

    assert FIXTURES["model_sha256"] == resolve.BUNDLED_MODELS["gemma3"].sha256
    assert resolve.resolve_model_path("gemma3").name == FIXTURES["model_file"]


def test_fixtures_cover_the_hard_cases() -> None:
    texts = " ".join(case["text"] for case in FIXTURES["tokenize"])
    for sample in (
        "日本語",
        "🎉",
        "👩‍👩‍👧",
        "مرحبا",
        "     ",
        "\t",
        "\r\n",
        "def f(x):",
        "<start_of_turn>",
        "<bos>",
        "\u200b",
    ):
        assert sample in texts, sample


@pytest.mark.parametrize("case", FIXTURES["tokenize"], ids=lambda c: repr(c["text"][:24]))
def test_tokenization_matches_llamacpp(gemma3_tokenizer, case: dict) -> None:
    """SentencePiece ranked by score, byte fallback for what the vocabulary lacks, special tokens
    parsed: the same ids as llama.cpp's /tokenize, and decoding gives the text back."""
    assert gemma3_tokenizer.encode(case["text"]) == case["ids"]
    assert gemma3_tokenizer.decode(case["ids"], skip_special_tokens=False) == case["text"]


def test_chat_prompts_start_as_llamacpps(gemma3) -> None:
    """The file asks for <bos>: a prompt rebar builds from text starts with it, as llama.cpp's does."""
    from rebar.engine.prompt import prompt_token_ids

    for case in FIXTURES["cases"]:
        assert prompt_token_ids(gemma3.tokenizer, case["text"]) == case["prompt_ids"]


def test_generation_ends_at_the_end_of_turn(gemma3_tokenizer) -> None:
    """The file names only <eos> as its end; a chat reply ends with <end_of_turn>, which llama.cpp
    also treats as the end of generation."""
    special = gemma3_tokenizer.special
    ends = {gemma3_tokenizer.id_to_token(i) for i in special.eos_token_ids}
    assert ends == {"<eos>", "<end_of_turn>"}


# Where the engines' greedy paths part, llama.cpp's pick must be a near-tie in rebar's logits. Both
# round activations to 8 bits, in different blocks (llama.cpp 256 values per scale for K-quants,
# rebar 32), which moves single logits by up to ~1 here; at the partings seen, rebar's float32
# reference (transformers' math to 2e-4) sides with rebar as often as with llama.cpp, its own gap
# between the two candidates under 0.3. Since the Q5_0 / Q8_0 layers' activation scales are rounded
# to float16 as llama.cpp's are, 7 of the 10 continuations are identical (5 before) on the AMD EPYC
# the fixtures were made on; of the three partings, the widest is 0.55 at token 11 of the
# prime-number answer. On an Intel Xeon (torch's float32 kernels round otherwise) 6 are, every
# parting still a near-tie: the count guards against a drop, the near-tie check is the criterion.
NEAR_TIE = 0.6
IDENTICAL = 6


def test_default_greedy_continuations_follow_llamacpps(gemma3) -> None:
    """rebar's default path (Q4_K/Q6_K kept as they are, the fused decode step, a float16 KV cache)
    continues llama.cpp's prompt ids identically in most cases; where a continuation parts from
    llama.cpp's, it is at a near-tie of rebar's own logits."""
    from rebar import SamplingParams

    cases = FIXTURES["cases"]
    params = SamplingParams(max_tokens=FIXTURES["tokens_per_prompt"], temperature=0.0)
    outputs = gemma3.generate([case["prompt_ids"] for case in cases], params)
    identical = 0
    for case, output in zip(cases, outputs):
        ours, theirs = list(output.token_ids), case["greedy_ids"]
        if ours == theirs:
            identical += 1
            continue
        split = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
        )
        assert split < min(len(ours), len(theirs)), "one engine stopped where the other went on"
        logits = gemma3.logits(case["prompt_ids"] + theirs[:split])[-1]
        gap = float(logits[ours[split]] - logits[theirs[split]])
        assert abs(gap) < NEAR_TIE, (case["text"][:40], split, gap)
    assert identical >= IDENTICAL, f"{identical} of {len(cases)} continuations identical"
