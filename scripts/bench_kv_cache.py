"""Single-stream decode at depth over each KV cache dtype, alternated in one run.

    PYTHONPATH=src .venv/bin/python scripts/bench_kv_cache.py [--model smollm2] [--depth 4096] \
        [--dtypes float16,q8_0] [--rounds 5] [--gen-tokens 32] [--threads 2]

Loads the model once per `[engine] kv_cache_dtype` (rebar's defaults otherwise, speculation off so
each token is one step, as llama-bench's tg), prefills one random `--depth`-token prompt in each
and then, round after round, alternating the dtypes, decodes `--gen-tokens` greedy tokens after that
prompt (a prefix-cache hit, so only the decode is timed). Prints each dtype's median tokens/s over
the rounds and their ratio to the first dtype's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from rebar.engine.sampling_params import SamplingParams
from rebar.llm import LLM


def decode_rate(llm: LLM, prompt: list[int], gen_tokens: int, request_id: str) -> float:
    """Tokens/s of the decode steps after the first token (prefill and the first token untimed)."""
    engine = llm.engine
    assert engine is not None
    params = SamplingParams(max_tokens=gen_tokens + 1, temperature=0, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            stamps.extend(time.perf_counter() for _ in output.new_token_ids)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--depth", type=int, default=4096)
    parser.add_argument("--dtypes", default="float16,q8_0")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    engines = {
        dtype: LLM(
            args.model,
            kv_cache_dtype=dtype,
            speculative=False,
            max_model_len=args.depth + args.gen_tokens + 64,
        )
        for dtype in dtypes
    }
    vocab = engines[dtypes[0]].config.vocab_size
    prompt = [random.Random(0).randrange(1000, vocab) for _ in range(args.depth)]
    for dtype, llm in engines.items():  # the prefill, kept in each engine's prefix cache
        started = time.perf_counter()
        decode_rate(llm, prompt, 1, f"{dtype}-prefill")
        print(f"{dtype}: prefilled {args.depth} tokens in {time.perf_counter() - started:.1f} s")
    rates: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    for round_index in range(args.rounds):
        order = dtypes if round_index % 2 == 0 else dtypes[::-1]
        for dtype in order:
            rate = decode_rate(engines[dtype], prompt, args.gen_tokens, f"{dtype}-{round_index}")
            rates[dtype].append(rate)
        print(f"round {round_index}: " + ", ".join(f"{d} {rates[d][-1]:.2f}" for d in dtypes))
    first = statistics.median(rates[dtypes[0]])
    for dtype in dtypes:
        median = statistics.median(rates[dtype])
        print(
            f"{args.model} depth {args.depth} {dtype}: {median:.2f} tok/s median "
            f"({min(rates[dtype]):.2f}-{max(rates[dtype]):.2f}), {median / first:.3f}x {dtypes[0]}"
        )


if __name__ == "__main__":
    main()
