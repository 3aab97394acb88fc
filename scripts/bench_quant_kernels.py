"""Micro-benchmark of the linear kernels on SmolLM2-135M's weight shapes (dev tool).

For each shape (in -> out) and batch size, times a dense float32 and bfloat16 matmul and every
quantized kernel in rebar.weights.qlinear (packed int8 / int4 and dequantize-then-matmul), as the
median of many calls with float32 activations, and prints a Markdown table in microseconds. As in a
model's forward pass, weights are not in cache: each call uses the next of enough distinct copies
of the weight to fill --cold-mib of float32. The packed kernels' row limits in qlinear.py come from
where they stop beating dequantize-then-matmul.

    PYTHONPATH=src python scripts/bench_quant_kernels.py [--batch 1,16] [--group-size 64] \
        [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rebar.weights.int_formats import quantize_int4, quantize_int8
from rebar.weights.qlinear import DequantizedMatmul, Int4PackedMatmul, Int8PackedMatmul

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out)


def median_us(fn: Callable[[], torch.Tensor], min_seconds: float) -> float:
    fn()
    fn()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 7 or (time.perf_counter() - started < min_seconds and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class Rotating:
    """Calls the next of several equivalent kernels each time, so no weight stays in cache."""

    def __init__(self, kernels: list[Callable[[torch.Tensor], torch.Tensor]]) -> None:
        self.kernels = kernels
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.kernels[self.calls % len(self.kernels)](x)


def dense(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.linear(x.to(weight.dtype), weight).float()


def kernels_for(
    in_features: int, out_features: int, group_size: int, cold_bytes: int
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    copies = max(2, -(-cold_bytes // (4 * in_features * out_features)))
    weights = [torch.randn(out_features, in_features) * 0.02 for _ in range(copies)]
    int8 = [quantize_int8(w) for w in weights]
    int4 = [quantize_int4(w, group_size) for w in weights]
    return {
        "fp32 dense": Rotating([dense(w) for w in weights]),
        "bf16 dense": Rotating([dense(w.to(torch.bfloat16)) for w in weights]),
        "int8pack": Rotating([Int8PackedMatmul(q) for q in int8]),
        "int8 dequant+fp32": Rotating([DequantizedMatmul(q) for q in int8]),
        f"int4pack g{group_size}": Rotating([Int4PackedMatmul(q) for q in int4]),
        f"int4 g{group_size} dequant+fp32": Rotating([DequantizedMatmul(q) for q in int4]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,4,16,32,64,256", help="comma-separated row counts")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--min-seconds", type=float, default=0.3, help="time spent per measurement")
    parser.add_argument(
        "--cold-mib",
        type=int,
        default=256,
        help="float32 MiB of distinct weight copies cycled through",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches = [int(b) for b in args.batch.split(",")]
    print(
        f"torch {torch.__version__}, {args.threads} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, weights cycled through {args.cold_mib} MiB"
    )
    header = None
    for in_features, out_features in SHAPES:
        kernels = kernels_for(in_features, out_features, args.group_size, args.cold_mib * 2**20)
        if header is None:
            header = ["shape", "rows", *kernels]
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
        for rows in batches:
            x = torch.randn(rows, in_features)
            with torch.inference_mode():
                cells = [
                    f"{median_us(lambda k=k, x=x: k(x), args.min_seconds):.0f}"
                    for k in kernels.values()
                ]
            print(
                f"| {in_features}->{out_features} | {rows} | " + " | ".join(cells) + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
