"""`rebar quantize`: argument parsing and the command (heavy imports happen only when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

METHOD_CHOICES = ("int8", "int4-rtn", "int4-awq")


def add_quantize_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "quantize",
        help="write an int8 / int4 quantized checkpoint "
        "(safetensors + manifest) that --model accepts",
        description="Quantize a decoder's linear layers. int8: symmetric, per output channel "
        "unless --group-size; int4-rtn: grouped asymmetric, round to nearest; int4-awq: "
        "activation-aware scales and clipping searched on --calib text. The token embedding (and "
        "an untied output head) is stored int8.",
    )
    parser.add_argument("model", help="alias (smollm2), a .gguf file or an HF folder")
    parser.add_argument("--method", required=True, choices=METHOD_CHOICES)
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="input channels per scale: 32, 64 or 128 (int4 default 64; int8 default per channel)",
    )
    parser.add_argument(
        "--calib",
        type=Path,
        default=None,
        help="JSONL calibration text (int4-awq only), e.g. data/corpus/calib.jsonl",
    )
    parser.add_argument("--text-field", default="text", help="JSON field holding the text")
    parser.add_argument("--calib-samples", type=int, default=32, help="calibration sequences")
    parser.add_argument(
        "--calib-seq-len", type=int, default=512, help="tokens per calibration sequence"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the calibration sampling")
    parser.add_argument(
        "--out", type=Path, required=True, help="output folder (must not exist or be empty)"
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bars"
    )
    parser.set_defaults(handler=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from rebar.quant.quantize import QuantizeSpec, quantize

    spec = QuantizeSpec(
        method=args.method,
        group_size=args.group_size,
        calib_path=args.calib,
        calib_sequences=args.calib_samples,
        calib_seq_len=args.calib_seq_len,
        text_field=args.text_field,
        seed=args.seed,
    )
    result = quantize(args.model, spec, args.out, progress=args.progress)
    sizes = sum(p.stat().st_size for p in result.folder.iterdir() if p.suffix == ".safetensors")
    print(
        f"wrote {result.folder} ({args.method}, {sizes / 2**20:.1f} "
        f"MiB of weights) in {result.seconds:.1f}s"
    )
    if result.awq is not None:
        searches = result.awq.searches.values()
        gain = sum(s.error / s.unscaled_error for s in searches if s.unscaled_error > 0) / max(
            len(searches), 1
        )
        print(
            f"activation-aware scales: layer output error {gain:.2f}x "
            "that of unscaled weights on average (same rounding)"
        )
    return 0
