"""How fast rebar's CPU kernels stream each weight kind at one activation row (dev tool).

One row is decode: every weight byte is read once, so the figure is bytes per second. `--copies`
distinct weights are called in turn so they stream from memory, not cache; each weight is packed
as the loader packs it (`pack_in_row_chunks`: huge pages where the kernel allows) unless
`--small-pages` asks for plain torch memory. Reports the best of `--repeats` rounds.

    PYTHONPATH=src python scripts/bench_weight_bandwidth.py --threads 2
    PYTHONPATH=src python scripts/bench_weight_bandwidth.py --threads 2 --small-pages
"""

from __future__ import annotations

import argparse
import time

import torch

from rebar.kernels import cpu_quant


def make(kind: str, out: int, inn: int, small_pages: bool) -> cpu_quant.PackedQuant:
    def pack(start: int, end: int) -> cpu_quant.PackedQuant:
        rows = end - start
        half = lambda cols: torch.rand(rows, cols).half()  # noqa: E731
        byte = lambda cols, high: torch.randint(0, high, (rows, cols), dtype=torch.uint8)  # noqa: E731
        if kind == "Q4_1":
            return cpu_quant.pack_affine(byte(inn, 16), 4, half(inn // 32), half(inn // 32), 32)
        if kind == "Q4_0":
            return cpu_quant.pack_sym(byte(inn, 16), 4, half(inn // 32), 32, 8)
        if kind == "Q8_0":
            return cpu_quant.pack_sym(byte(inn, 256), 8, half(inn // 32), 32, 128)
        if kind == "Q4_K":
            return cpu_quant.pack_super_affine(
                byte(inn, 16),
                4,
                half(inn // 256),
                half(inn // 256),
                byte(inn // 32, 64),
                byte(inn // 32, 64),
            )
        return cpu_quant.pack_super_sym(
            byte(inn, 64),
            6,
            half(inn // 256),
            torch.randint(-128, 128, (rows, inn // 16), dtype=torch.int8),
            32,
        )

    return pack(0, out) if small_pages else cpu_quant.pack_in_row_chunks(out, out, pack)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", type=int, nargs=2, default=(8192, 2048), metavar=("OUT", "IN"))
    parser.add_argument("--copies", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--small-pages", action="store_true", help="plain torch memory instead of huge pages"
    )
    parser.add_argument("--kinds", nargs="+", default=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out, inn = args.shape
    x = torch.randn(1, inn)
    for kind in args.kinds:
        weights = [make(kind, out, inn, args.small_pages) for _ in range(args.copies)]
        for weight in weights:
            cpu_quant.linear_packed(x, weight)
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            for weight in weights:
                cpu_quant.linear_packed(x, weight)
            best = min(best, (time.perf_counter() - started) / len(weights))
        nbytes = weights[0].num_bytes
        print(
            f"{kind:5s} {out}x{inn}: {best * 1e6:8.1f} us per call, "
            f"{nbytes / best / 1e9:6.2f} GB/s ({nbytes / 2**20:.1f} MiB)"
        )


if __name__ == "__main__":
    main()
