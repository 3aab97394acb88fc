"""`rebar eval ppl`: argument parsing and the command (heavy imports happen only when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_eval_parser(commands: Any, add_model_args: Any) -> None:
    evaluations = commands.add_parser("eval", help="model quality").add_subparsers(
        dest="evaluation", required=True
    )
    ppl = evaluations.add_parser(
        "ppl",
        help="perplexity over a text or JSONL file with a sliding window",
        description="Windows of --context tokens; after the first, each scores the next --stride "
        "tokens, so every token is predicted once with at least context - stride tokens of "
        "history.",
    )
    add_model_args(ppl, skip={"max_model_len"})  # --context sets it
    ppl.add_argument(
        "--data",
        type=Path,
        required=True,
        help="a .jsonl file (texts joined by blank lines) or a UTF-8 text file",
    )
    ppl.add_argument("--text-field", default="text", help="JSON field holding the text (.jsonl)")
    ppl.add_argument("--context", type=int, default=1024, help="tokens per window")
    ppl.add_argument(
        "--stride", type=int, default=512, help="new tokens scored per window (less than --context)"
    )
    ppl.add_argument(
        "--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the data"
    )
    ppl.set_defaults(handler=cmd_eval_ppl)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from rebar.config.flags import settings_from_flags
    from rebar.errors import InvalidRequestError
    from rebar.eval.perplexity import evaluation_tokens, perplexity, sliding_windows

    # Check what can be checked before the (slow) load.
    sliding_windows(2, args.context, args.stride)
    if not args.data.is_file():
        raise InvalidRequestError(f"data file {args.data} does not exist", "data")
    from rebar.llm import LLM

    settings = settings_from_flags(args, **{"engine.max_model_len": args.context})
    llm = LLM.from_settings(args.model, settings)
    ids = evaluation_tokens(llm.tokenizer, args.data, args.text_field, args.max_tokens)
    result = perplexity(llm.logits, ids, args.context, args.stride)
    print(f"perplexity: {result.perplexity:.4f}")
    print(
        f"tokens:     {result.num_scored} scored in {result.num_windows} "
        f"windows (context {result.context}, stride {result.stride})"
    )
    print(
        f"time:       {result.seconds:.1f}s ({result.num_scored / result.seconds:.0f} "
        f"tokens/s), load {llm.load_seconds:.1f}s"
    )
    return 0
