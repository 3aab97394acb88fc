"""A decoding stream's step time while a long prompt prefills in a thread of its own beside it,
measured on `ModelRunner` alone: the design measurement behind the engine's `prefill_beside_decode`
(scripts/bench_long_prompt_neighbours.py measures the engine itself).

    PYTHONPATH=src .venv/bin/python scripts/bench_prefill_beside_decode_threads.py \
        [--model gemma3] [--prompt-tokens 16384] [--chunk 2048] [--nice 0]

Loads the model with rebar's defaults (no speculation) and drives its `ModelRunner` directly: a
one-token decode step on a short sequence, 40 times alone (its idle step time), then the whole
prompt of random tokens alone, chunk by chunk (its prefill time); then the prompt again in a
second thread (`--nice` lowers that thread's priority, and so its OpenMP threads') while the first
thread runs decode steps back to back until the prompt is done. Prints the stream's median and
90th-percentile step time against idle, the prompt's time alone and beside the stream, and whether
the prompt's last logits came out bit for bit the same both times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time

from rebar.openmp_env import shorten_openmp_spin

shorten_openmp_spin()  # before torch loads libgomp: what `make run` gets

import torch  # noqa: E402

from rebar.engine.scheduler import ScheduledRequest  # noqa: E402
from rebar.llm import LLM  # noqa: E402

STREAM_BLOCKS = 8  # the decoding sequence's blocks: it cycles over positions 40..119


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3")
    parser.add_argument("--prompt-tokens", type=int, default=16_384)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, speculative=False)
    engine = llm.engine
    assert engine is not None, f"{args.model} does not generate"
    runner, size = engine.runner, engine.runner.block_size
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    prompt = [rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_tokens)]
    prompt_blocks = tuple(range(-(-len(prompt) // size)))
    stream_blocks = tuple(range(len(prompt_blocks), len(prompt_blocks) + STREAM_BLOCKS))

    def prefill() -> torch.Tensor:
        logits = torch.empty(0)
        for start in range(0, len(prompt), args.chunk):
            tokens = tuple(prompt[start : start + args.chunk])
            last = start + len(tokens) == len(prompt)
            item = ScheduledRequest("long", tokens, start, prompt_blocks, last, prompt=True)
            logits = runner.execute([item])
        return logits

    def decode_step(position: int) -> None:
        runner.execute([ScheduledRequest("stream", (1234,), position, stream_blocks, True)])

    def step_times(count: int, until: threading.Event | None = None) -> list[float]:
        times, last, step = [], time.perf_counter(), 0
        while (until is None and step < count) or (until is not None and not until.is_set()):
            decode_step(40 + step % 80)
            now = time.perf_counter()
            times.append(now - last)
            last, step = now, step + 1
        return times

    idle = statistics.median(step_times(40)[5:])
    started = time.perf_counter()
    alone = prefill()
    alone_s = time.perf_counter() - started
    done, result = threading.Event(), {}

    def background() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.nice)
        began = time.perf_counter()
        result["logits"] = prefill()
        result["seconds"] = time.perf_counter() - began
        done.set()

    thread = threading.Thread(target=background)
    thread.start()
    busy = step_times(0, done)
    thread.join()
    ordered = sorted(busy)
    report = {
        "model": args.model,
        "prompt_tokens": len(prompt),
        "chunk": args.chunk,
        "nice": args.nice,
        "idle_step_ms": round(1000 * idle, 2),
        "step_ms_median": round(1000 * statistics.median(busy), 2),
        "step_ms_p90": round(1000 * ordered[int(0.9 * len(ordered))], 2),
        "median_vs_idle": round(statistics.median(busy) / idle, 2),
        "p90_vs_idle": round(ordered[int(0.9 * len(ordered))] / idle, 2),
        "prefill_alone_s": round(alone_s, 2),
        "prefill_beside_stream_s": round(result["seconds"], 2),
        "same_logits": bool(torch.equal(alone, result["logits"])),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
