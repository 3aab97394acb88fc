"""`rebar contract write | check`: record what a model is today, or check it against a contract."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rebar.errors import ConfigError


def _load(args: argparse.Namespace):
    from rebar.config.flags import settings_from_flags
    from rebar.llm import LLM

    return LLM.from_settings(args.model, settings_from_flags(args))


def _where(args: argparse.Namespace, llm) -> Path:
    from rebar.engine.contract import contract_path

    return Path(args.contract) if args.contract else contract_path(llm.checkpoint.path)


def cmd_contract_write(args: argparse.Namespace) -> int:
    from rebar.engine.contract import DEFAULT_PROMPTS, record

    llm = _load(args)
    contract = record(llm, args.prompt or DEFAULT_PROMPTS, args.tokens, args.rebar_versions)
    path = _where(args, llm)
    if path.exists() and not args.force:
        raise ConfigError(f"{path} exists; pass --force to replace it")
    path.write_text(contract.to_toml(), encoding="utf-8")
    print(f"wrote {path} ({len(contract.golden)} golden prompts)")
    return 0


def cmd_contract_check(args: argparse.Namespace) -> int:
    from rebar.engine.contract import Contract, check

    llm = _load(args)
    path = _where(args, llm)
    problems = check(llm, Contract.read(path))
    for problem in problems:
        print(f"mismatch: {problem}")
    print(f"{llm.checkpoint.path}: {'breaks' if problems else 'meets'} its contract {path}")
    return 1 if problems else 0


def add_contract_parser(commands: Any, add_model_args) -> None:
    contract = commands.add_parser(
        "contract", help="model contracts: what a service relies on about a model"
    ).add_subparsers(dest="contract", required=True)
    write = contract.add_parser("write", help="record the contract a model meets now")
    add_model_args(write)
    write.add_argument(
        "--contract", default=None, help="where to write (default: beside the model)"
    )
    write.add_argument(
        "--prompt", action="append", help="a golden prompt (repeat; default: three built in)"
    )
    write.add_argument("--tokens", type=int, default=8, help="greedy tokens per golden prompt")
    write.add_argument("--rebar-versions", default=None, help="version range (default: this minor)")
    write.add_argument("--force", action="store_true", help="replace an existing contract")
    write.set_defaults(handler=cmd_contract_write)
    check = contract.add_parser(
        "check", help="check a model against its contract (exit 1: breaks it)"
    )
    add_model_args(check)
    check.add_argument("--contract", default=None, help="the contract (default: beside the model)")
    check.set_defaults(handler=cmd_contract_check)
