"""Quantized linear kernels vs torch on SmolLM2-135M's shapes: per-call µs at batch 1 and 16.

    PYTHONPATH=src .venv/bin/python scripts/bench_cpu_quant.py [--threads 2] [--layers 30] \
        [--repeats 3]

Each method gets `--layers` distinct copies of one decoder layer's seven weights (q, k, v, o,
gate, up, down), called in forward order, so weights stream from memory as in a real forward
instead of staying cache-hot; the lm_head (49152 x 576) is one copy, far larger than the caches.
Methods: float32 F.linear, torch._weight_int8pack_mm (int8, per-channel scales),
torch._weight_int4pack_mm_for_cpu (int4, group 32), and rebar's int4 (group 32, float16 scale and
offset, like GGUF Q4_1) and int8 (per-channel) kernels. All take float32 activations.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rebar.kernels import cpu_quant

LAYER_SHAPES = [  # (name, out_features, in_features)
    ("q", 576, 576),
    ("k", 192, 576),
    ("v", 192, 576),
    ("o", 576, 576),
    ("gate", 1536, 576),
    ("up", 1536, 576),
    ("down", 576, 1536),
]
LM_HEAD = ("lm_head", 49152, 576)
GROUP = 32

Linear = Callable[[torch.Tensor], torch.Tensor]
Stat = Callable[[list[float]], float]
# On a shared machine a 2-thread call now and then waits a whole scheduler slice for its second
# thread: the median shows what a busy machine gives, the minimum what a quiet one does.
STATS: dict[str, Stat] = {"median": statistics.median, "min": min}


def fp32_linear(out_f: int, in_f: int) -> Linear:
    weight = torch.randn(out_f, in_f) * 0.05
    return lambda x: F.linear(x, weight)


def torch_int8(out_f: int, in_f: int) -> Linear:
    codes = torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8)
    scales = torch.rand(out_f) * 1e-3
    return lambda x: torch._weight_int8pack_mm(x, codes, scales)


def torch_int4(out_f: int, in_f: int) -> Linear:
    codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    scales_and_zeros = torch.rand(in_f // GROUP, out_f, 2) * 1e-2
    return lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)


def rebar_int4(out_f: int, in_f: int) -> Linear:
    qweight = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8)
    scales = (torch.rand(out_f, in_f // GROUP) * 1e-2).half()
    offsets = (torch.randn(out_f, in_f // GROUP) * 1e-2).half()
    packed = cpu_quant.pack_int4(qweight, scales, offsets, GROUP)
    return lambda x: cpu_quant.linear_packed(x, packed)


def rebar_int8(out_f: int, in_f: int) -> Linear:
    packed = cpu_quant.pack_int8(
        torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8), torch.rand(out_f, 1) * 1e-3, in_f
    )
    return lambda x: cpu_quant.linear_packed(x, packed)


METHODS: dict[str, Callable[[int, int], Linear]] = {
    "torch fp32 F.linear": fp32_linear,
    "torch _weight_int8pack_mm": torch_int8,
    "torch _weight_int4pack_mm_for_cpu": torch_int4,
    "rebar linear_packed int8": rebar_int8,
    "rebar linear_packed int4 (Q4_1-like)": rebar_int4,
}


def time_layers(
    layers: list[list[Linear]], inputs: list[torch.Tensor], repeats: int, stat: Stat
) -> list[float]:
    """µs per call of each layer shape (median or min over calls), over `repeats` passes through
    every layer copy."""
    samples: list[list[float]] = [[] for _ in LAYER_SHAPES]
    for rep in range(repeats + 1):  # the first pass warms up
        for layer in layers:
            for i, (linear, x) in enumerate(zip(layer, inputs)):
                start = time.perf_counter()
                linear(x)
                if rep:
                    samples[i].append(time.perf_counter() - start)
    return [stat(times) * 1e6 for times in samples]


def time_single(linear: Linear, x: torch.Tensor, repeats: int, stat: Stat) -> float:
    linear(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        linear(x)
        times.append(time.perf_counter() - start)
    return stat(times) * 1e6


def time_packing(layers: int) -> float:
    """Seconds to pack SmolLM2-135M's int4 weights (every layer and the lm_head), as at model
    load."""
    shapes = [(out_f, in_f) for _, out_f, in_f in LAYER_SHAPES] * layers + [LM_HEAD[1:]]
    raw = [
        (
            torch.randint(0, 256, (o, i // 2), dtype=torch.uint8),
            torch.rand(o, i // GROUP).half(),
            torch.rand(o, i // GROUP).half(),
        )
        for o, i in shapes
    ]
    start = time.perf_counter()
    for qweight, scales, offsets in raw:
        cpu_quant.pack_int4(qweight, scales, offsets, GROUP)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--stat", choices=sorted(STATS), default="median")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stat = STATS[args.stat]
    torch.manual_seed(0)
    start = time.perf_counter()
    if not cpu_quant.available():
        raise SystemExit("rebar's CPU kernels are unavailable here (see the log above)")
    print(f"extension ready in {time.perf_counter() - start:.1f} s (a first build compiles it)")
    print(f"packing SmolLM2-135M's int4 weights: {time_packing(args.layers):.2f} s")

    header = f"{'method':38s} {'rows':>4s} " + " ".join(
        f"{name:>6s}" for name, _, _ in LAYER_SHAPES
    )
    print(
        f"{args.stat} µs per call, {args.threads} threads, {args.layers} "
        "layer copies; token ms = layers x layer + lm_head\n"
    )
    print(header + f" {'layer':>7s} {'lm_head':>8s} {'token ms':>8s}")
    for method, make in METHODS.items():
        layers = [
            [make(out_f, in_f) for _, out_f, in_f in LAYER_SHAPES] for _ in range(args.layers)
        ]
        lm_head = make(LM_HEAD[1], LM_HEAD[2])
        for rows in args.rows:
            inputs = [torch.randn(rows, in_f) for _, _, in_f in LAYER_SHAPES]
            per_shape = time_layers(layers, inputs, args.repeats, stat)
            head = time_single(lm_head, torch.randn(rows, LM_HEAD[2]), 9, stat)
            layer = sum(per_shape)
            token_ms = (layer * args.layers + head) / 1e3  # matmuls of one forward step (30 layers)
            cells = " ".join(f"{us:6.0f}" for us in per_shape)
            print(f"{method:38s} {rows:4d} {cells} {layer:7.0f} {head:8.0f} {token_ms:8.2f}")
        del layers, lm_head


if __name__ == "__main__":
    main()
