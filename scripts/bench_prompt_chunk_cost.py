"""What a step costs when it computes a few prompt tokens deep into a context, on each of the two
paths a step has: the model's prompt path (eager torch, SDPA) and the fused decode step.

    PYTHONPATH=src .venv/bin/python scripts/bench_prompt_chunk_cost.py [--model gemma3] \
        [--depths 0,2048,8192,16128] [--chunks 1,2,4,8,16,32,64] [--threads 2] [--repeats 5]

Loads the model with rebar's defaults (OpenMP spin shortened first, as the `rebar` command does),
fills one private run of KV blocks with a random prompt as long as the deepest depth, then at each
depth times `ModelRunner.execute` of:

- a chunk of k prompt tokens starting at that depth (no token sampled): the prompt path, which
  every chunk of more than one token takes; k = 1 is a decode row (the fused step);
- one token sampled plus k - 1 draft tokens after it: k one-token rows of the fused step, as a
  verification step computes them (logits for every row included).

Prints the medians in milliseconds. A decoding stream's inter-token time beside a long prompt is
its own step plus the prompt chunk's cost at the prompt's depth; the table shows how much of that
cost does not shrink with the chunk (docs/benchmarks.md, "Other streams while a long prompt
prefills").
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

from rebar.engine.scheduler import ScheduledRequest  # noqa: E402
from rebar.llm import LLM  # noqa: E402


def integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3")
    parser.add_argument("--depths", type=integers, default=[0, 2048, 8192, 16128])
    parser.add_argument("--chunks", type=integers, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model)
    engine = llm.engine
    assert engine is not None, f"{args.model} does not generate"
    runner, pool = engine.runner, engine.kv_manager.pool
    length = max(args.depths) + max(args.chunks)
    blocks = tuple(pool.allocate(-(-length // runner.block_size)))
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    tokens = [rng.randrange(1000, vocab - 1000) for _ in range(length)]
    budget = engine.config.max_num_batched_tokens
    for start in range(0, max(args.depths), budget):  # the context every depth attends over
        chunk = tokens[start : min(start + budget, max(args.depths))]
        runner.execute([ScheduledRequest("context", tuple(chunk), start, blocks, sample=False)])

    def median_ms(item: ScheduledRequest) -> float:
        runner.execute([item])  # the first call at a shape allocates
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            runner.execute([item])
            times.append(time.perf_counter() - began)
        return round(1000 * statistics.median(times), 2)

    rows = []
    for depth in args.depths:
        for k in args.chunks:
            piece = tuple(tokens[depth : depth + k])
            chunk = ScheduledRequest("chunk", piece, depth, blocks, sample=False)
            verify = ScheduledRequest(
                "rows",
                (tokens[depth],),
                depth,
                blocks,
                True,
                num_lookahead=k - 1,
                draft_token_ids=tuple(tokens[depth + 1 : depth + k]),
            )
            rows.append(
                {
                    "depth": depth,
                    "tokens": k,
                    "prompt_path_ms": median_ms(chunk),
                    "fused_rows_ms": median_ms(verify),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    pool.free(blocks)


if __name__ == "__main__":
    main()
