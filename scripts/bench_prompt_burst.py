"""A burst of long prompts arriving at once: when the last one finishes, first-token and
inter-token times.

    PYTHONPATH=src .venv/bin/python scripts/bench_prompt_burst.py [--model smollm2] \
        [--streams 16] [--prompt-tokens 2048] [--gen-tokens 32] [--rounds 2] \
        [--setting max_prefill_tokens_while_decoding=2048]

Loads the model with rebar's defaults (any `--setting name=value` of `[engine]` overrides one),
then, each round, adds `--streams` greedy requests of random prompts (never in the prefix cache,
not speculating) to the idle engine at once and drives it step by step until all are done. What
the `max_prefill_tokens_while_decoding` rule decides: how the first streams' tokens and the
later prompts' prefill share the steps.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = dict(item.split("=", 1) for item in args.setting)
    llm = LLM(args.model, **{name: json.loads(value) for name, value in settings.items()})
    engine = llm.engine
    assert engine is not None, f"{args.model} does not generate"
    tokenizer = llm.tokenizer
    allowed = [t for t in range(tokenizer.vocab_size) if not tokenizer.is_special(t)]
    rng = random.Random(0)
    params = SamplingParams(
        max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True, speculative=False
    )
    for round_ in range(args.rounds):
        started = time.monotonic()
        for stream in range(args.streams):
            prompt = [rng.choice(allowed) for _ in range(args.prompt_tokens)]
            engine.add_request(f"{round_}-{stream}", prompt, params)
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        gaps: list[float] = []
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.monotonic() - started
            for output in outputs:
                if not output.new_token_ids:
                    continue
                if output.request_id in last:
                    gaps.append(now - last[output.request_id])
                first.setdefault(output.request_id, now)
                last[output.request_id] = now
        gaps.sort()
        report = {
            "round": round_,
            "all_done_s": round(max(last.values()), 2),
            "first_token_median_s": round(statistics.median(first.values()), 2),
            "first_token_max_s": round(max(first.values()), 2),
            "inter_token_median_ms": round(1e3 * statistics.median(gaps), 1),
            "inter_token_p90_ms": round(1e3 * gaps[int(0.9 * len(gaps))], 1),
        }
        print(json.dumps({"model": args.model, **settings, **report}))


if __name__ == "__main__":
    main()
