"""Micro-benchmark of the linear kernels on SmolLM2-135M's weight shapes (dev tool).

For each shape (in -> out) and batch size, times a dense float32 and bfloat16 matmul and every
quantized kernel in rebar.quant.qlinear (packed int8 / int4 and dequantize-then-matmul), as the
median of many calls with float32 activations, and prints a Markdown table in microseconds. The
packed kernels' row limits in qlinear.py come from where they stop beating dequantize-then-matmul.

    PYTHONPATH=src python scripts/bench_quant_kernels.py [--batch 1,16] [--group-size 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rebar.quant.int_formats import quantize_int4, quantize_int8
from rebar.quant.qlinear import DequantizedMatmul, Int4PackedMatmul, Int8PackedMatmul

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


def kernels_for(in_features: int, out_features: int, group_size: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    weight = torch.randn(out_features, in_features) * 0.02
    weight_bf16 = weight.to(torch.bfloat16)
    int8 = quantize_int8(weight)
    int4 = quantize_int4(weight, group_size)
    return {
        "fp32 dense": lambda x: F.linear(x, weight),
        "bf16 dense": lambda x: F.linear(x.to(torch.bfloat16), weight_bf16).float(),
        "int8pack": Int8PackedMatmul(int8),
        "int8 dequant+fp32": DequantizedMatmul(int8),
        f"int4pack g{group_size}": Int4PackedMatmul(int4),
        f"int4 g{group_size} dequant+fp32": DequantizedMatmul(int4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,4,16,32,64,256", help="comma-separated row counts")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--min-seconds", type=float, default=0.3, help="time spent per measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches = [int(b) for b in args.batch.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    header = None
    for in_features, out_features in SHAPES:
        kernels = kernels_for(in_features, out_features, args.group_size)
        if header is None:
            header = ["shape", "rows", *kernels]
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
        for rows in batches:
            x = torch.randn(rows, in_features)
            with torch.inference_mode():
                cells = [f"{median_us(lambda k=k: k(x), args.min_seconds):.0f}" for k in kernels.values()]
            print(f"| {in_features}->{out_features} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
