"""One prompt's prefill through rebar's int4 kernels vs dequantize + float32 GEMM, alternating in
one process.

    PYTHONPATH=src .venv/bin/python scripts/bench_prefill_paths.py [--threads 2] [--tokens 512] \
        [--rounds 3]

Loads SmolLM2 from its GGUF with the weights kept quantized, then times `generate(max_tokens=1)` on
fresh random prompts (so the prefix cache never helps) with every int4 QuantLinear pinned to one
path or the other, alternating the two paths round by round so that a machine whose speed drifts
affects both alike. Prints the best of three prompts per round, in seconds.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch

from rebar.engine.sampling_params import SamplingParams
from rebar.llm import LLM
from rebar.weights.qlinear import DequantizedMatmul, KernelChoice, QuantLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2", max_model_len=2048, max_num_batched_tokens=2048)
    int4 = [
        m
        for m in llm.model.modules()
        if isinstance(m, QuantLinear) and m.weight_q.describe() in ("Q4_0", "Q4_1")
    ]
    plans = {
        "rebar int4 kernel": {id(m): m.kernels for m in int4},
        "dequantize + fp32": {
            id(m): (KernelChoice(math.inf, DequantizedMatmul(m.weight_q)),) for m in int4
        },
    }
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size

    def time_prefill() -> float:
        prompt = [rng.randrange(1000, vocab) for _ in range(args.tokens)]
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        return time.perf_counter() - start

    print(f"{len(int4)} int4 linears, {args.threads} threads, {args.tokens}-token prompts")
    for round_index in range(args.rounds):
        for name, plan in plans.items():
            for module in int4:
                module.kernels = plan[id(module)]
            time_prefill()  # warm-up
            print(
                f"round {round_index + 1}: {name:18s} {min(time_prefill() for _ in range(3)):.3f} s"
            )


if __name__ == "__main__":
    main()
