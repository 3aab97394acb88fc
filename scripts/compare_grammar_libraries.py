"""Token-mask cost of llguidance (rebar's grammar library) against xgrammar, on one model's
vocabulary: how rebar chose. Dev-only: xgrammar is not a rebar dependency.

    .venv/bin/pip install xgrammar==0.2.8
    .venv/bin/python scripts/compare_grammar_libraries.py smollm2 gemma3

Per library and grammar (a six-field JSON schema, and any JSON object): the grammar tokenizer's
build time, the first compile and a cached one, and the time to fill one sequence's mask before
each token of a valid document, alone and for 16 sequences at once (the library's own batch API
with 2 threads, and one after another). Both write the same bitmask layout; rebar applies it with
its own kernel (rebar.kernels.token_mask), so applying is not compared here.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

import llguidance
import llguidance.torch as llguidance_torch
import torch
import xgrammar

from rebar.engine.grammar import JSON_OPTIONS
from rebar.model.loader import open_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "W1"},
    "active": True,
}
BATCH = 16


def micros(times: list[float]) -> str:
    us = [t * 1e6 for t in times]
    return f"mean {statistics.mean(us):7.1f} us, p50 {statistics.median(us):7.1f} us"


def timed(function: Callable[[], object]) -> tuple[object, float]:
    started = time.perf_counter()
    result = function()
    return result, time.perf_counter() - started


def time_each_token(ids: list[int], steps: dict[str, Callable[[], object]], advance) -> dict:
    """Seconds per token of each step in `steps`, calling `advance(token)` after each token."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for token in ids:
        for name, step in steps.items():
            times[name].append(timed(step)[1])
        advance(token)
    return times


def run_xgrammar(tokenizer, vocab: int, ids: list[int]) -> None:
    backend_json = tokenizer.backend_json()
    (info, seconds) = timed(
        lambda: xgrammar.TokenizerInfo(
            [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)],
            **_xgrammar_vocab_kind(backend_json),
            vocab_size=vocab,
            stop_token_ids=list(tokenizer.special.eos_token_ids),
        )
    )
    print(f"  xgrammar: tokenizer info {seconds:.2f} s")
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)
    for label, compile_grammar in (
        ("schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)),
        (
            "object",
            lambda: compiler.compile_json_schema('{"type": "object"}', any_whitespace=False),
        ),
    ):
        grammar, first = timed(compile_grammar)
        _, cached = timed(compile_grammar)
        matchers = [xgrammar.GrammarMatcher(grammar) for _ in range(BATCH + 1)]
        batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=2)
        mask_one = xgrammar.allocate_token_bitmask(1, vocab)
        mask_batch = xgrammar.allocate_token_bitmask(BATCH, vocab)
        steps = {
            "one": functools.partial(matchers[0].fill_next_token_bitmask, mask_one),
            "batch": functools.partial(
                batch_matcher.batch_fill_next_token_bitmask, matchers[1:], mask_batch
            ),
            "in turn": functools.partial(_fill_in_turn, matchers[1:], mask_batch),
        }
        accept = functools.partial(_advance_all, [m.accept_token for m in matchers])
        _report(label, first, cached, time_each_token(ids, steps, accept))


def _xgrammar_vocab_kind(backend_json: str) -> dict:
    # How xgrammar's own from_huggingface reads a tokenizer.json (byte-level or byte fallback).
    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend_json)
    return {"vocab_type": metadata["vocab_type"], "add_prefix_space": metadata["add_prefix_space"]}


def run_llguidance(tokenizer, vocab: int, ids: list[int]) -> None:
    grammar_tokenizer, seconds = timed(
        lambda: llguidance.LLTokenizer(
            tokenizer.backend_json(), n_vocab=vocab, eos_token=list(tokenizer.special.eos_token_ids)
        )
    )
    print(f"  llguidance: tokenizer {seconds:.2f} s")
    executor = llguidance.LLExecutor(num_threads=2)
    for label, schema in (("schema", SCHEMA), ("object", {"type": "object"})):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_OPTIONS
        )
        compiled, first = timed(functools.partial(llguidance.LLMatcher, grammar_tokenizer, grammar))
        _, cached = timed(compiled.deep_copy)  # rebar's cache: a copy of the compiled matcher
        matchers = [compiled.deep_copy() for _ in range(BATCH + 1)]
        mask_one = llguidance_torch.allocate_token_bitmask(1, vocab)
        mask_batch = llguidance_torch.allocate_token_bitmask(BATCH, vocab)
        pairs = [(m, j) for j, m in enumerate(matchers[1:])]
        steps = {
            "one": functools.partial(
                llguidance_torch.fill_next_token_bitmask, matchers[0], mask_one, 0
            ),
            "batch": functools.partial(
                llguidance_torch.fill_next_token_bitmask_par, executor, pairs, mask_batch
            ),
            "in turn": functools.partial(_fill_in_turn_llguidance, pairs, mask_batch),
        }
        consume = functools.partial(_advance_all, [m.consume_token for m in matchers])
        _report(label, first, cached, time_each_token(ids, steps, consume))


def _advance_all(advances, token: int) -> None:
    assert all(advance(token) for advance in advances), "a valid token was refused"


def _fill_in_turn(matchers, bitmask) -> None:
    for j, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, j)


def _fill_in_turn_llguidance(pairs, bitmask) -> None:
    for matcher, j in pairs:
        llguidance_torch.fill_next_token_bitmask(matcher, bitmask, j)


def _report(label: str, first: float, cached: float, times: dict[str, list[float]]) -> None:
    print(f"    {label}: compile {first * 1e3:.1f} ms (cached {cached * 1e3:.2f} ms)")
    print(f"      1 sequence:  {micros(times['one'])}")
    print(
        f"      {BATCH} at once:  {micros(times['batch'])} (batch API), "
        f"{micros(times['in turn'])} (in turn)"
    )


def main(models: list[str]) -> None:
    torch.set_num_threads(2)
    text = json.dumps(
        DOCUMENT, separators=(JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"])
    )
    for model in models:
        checkpoint = open_checkpoint(model)
        tokenizer, vocab = checkpoint.tokenizer, checkpoint.config.vocab_size
        ids = tokenizer.encode(text)
        print(f"{model}: vocabulary {vocab}, document {len(ids)} tokens")
        run_llguidance(tokenizer, vocab, ids)
        run_xgrammar(tokenizer, vocab, ids)


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2"])
