"""A decoding stream's inter-token time while a long prompt prefills beside it.

    PYTHONPATH=src .venv/bin/python scripts/bench_long_prompt_neighbours.py [--model gemma3] \
        [--prompt-tokens 16384] [--streams 1] [--threads 2] \
        [--setting max_prefill_tokens_while_decoding=256]

Loads the model with rebar's defaults and the `rebar` command's OpenMP setting (any `--setting
name=value` of `[engine]` overrides one; `none` unsets it), starts one greedy stream on a short
prompt (not speculating; `--streams` of them) and drives the engine step by step: first 60 steps
with the streams alone (their idle gaps between tokens), then a prompt of random tokens (never in
the prefix cache) arrives, and the gaps are recorded until that prompt's first token. Prints the
streams' median, 90th percentile and largest gap against their idle median, and the long prompt's
time to first token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from rebar.openmp_env import shorten_openmp_spin

shorten_openmp_spin()  # before torch loads libgomp: what `make run` gets

import torch  # noqa: E402

from rebar.engine.sampling_params import SamplingParams  # noqa: E402
from rebar.llm import LLM  # noqa: E402

IDLE_STEPS = 60


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3")
    parser.add_argument("--prompt-tokens", type=int, default=16_384)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings: dict[str, object] = {}  # the model's own context window, as `make run` serves it
    for item in args.setting:
        name, value = item.split("=", 1)
        settings[name] = None if value == "none" else json.loads(value)
    llm = LLM(args.model, **settings)
    engine = llm.engine
    assert engine is not None, f"{args.model} does not generate"
    # The stream does not speculate: each of its gaps is then one step, not a burst of drafts
    # whose length follows a policy timed at load.
    stream = SamplingParams(max_tokens=4000, ignore_eos=True, speculative=False)
    for index in range(args.streams):
        story = f"Tell me long story number {index} about the sea."
        engine.add_request(f"stream{index}", llm.tokenizer.encode(story), stream)

    last: dict[str, float] = {}
    idle: list[float] = []
    busy: list[float] = []
    long_started = first_token_s = None
    step = 0
    while first_token_s is None:
        outputs = engine.step()
        now = time.monotonic()
        for output in outputs:
            if output.request_id.startswith("stream") and output.new_token_ids:
                if output.request_id in last:
                    gaps = busy if long_started is not None else idle
                    gaps.append(now - last[output.request_id])
                last[output.request_id] = now
            elif output.request_id == "long" and output.new_token_ids:
                first_token_s = now - long_started
        step += 1
        if step == IDLE_STEPS:
            rng = random.Random(0)
            vocab = llm.tokenizer.vocab_size
            prompt = [rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_tokens)]
            engine.add_request("long", prompt, SamplingParams(max_tokens=1))
            long_started = time.monotonic()
    idle_median = statistics.median(idle[5:])  # the first steps warm up
    report = {
        "model": args.model,
        "settings": settings,
        "prompt_tokens": args.prompt_tokens,
        "streams": args.streams,
        "idle_gap_ms": round(1000 * idle_median, 2),
        "gap_ms_median": round(1000 * statistics.median(busy), 2),
        "gap_ms_p90": round(1000 * percentile(busy, 0.9), 2),
        "gap_ms_max": round(1000 * max(busy), 2),
        "median_vs_idle": round(statistics.median(busy) / idle_median, 2),
        "p90_vs_idle": round(percentile(busy, 0.9) / idle_median, 2),
        "long_prompt_first_token_s": round(first_token_s, 2),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
