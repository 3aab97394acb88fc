"""Model contracts: what a service relies on about a model, written down and checked before the
model is let in.

A contract (`rebar-contract.toml`) states the architecture, context length, RoPE base and scaling,
the weight storage types, SHA-256 hashes of the tokenizer and chat template, the rebar versions it
was written for, and a few golden prompts with their expected greedy tokens. `record` writes one
from a loaded model; `check` compares a model with one and returns every mismatch, each a line
naming the field, what the contract says and what the model has.

Where it lives: inside a model folder as `rebar-contract.toml`; beside a model file `M.gguf` as
`M.rebar-contract.toml` (`contract_path`). A contract given by path works for either.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from rebar.engine import run
from rebar.engine.prompt import prompt_token_ids
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import RebarError
from rebar.model.loader import Checkpoint

logger = logging.getLogger("rebar.contract")
CONTRACT_FILE = "rebar-contract.toml"
FORMAT = 1
# Golden prompts `record` uses when given none: short, and unlike each other.
DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,")
DEFAULT_GOLDEN_TOKENS = 8


class ContractError(RebarError):
    """A model breaks its contract, or a contract file cannot be read; the message lists why."""


@dataclass(frozen=True)
class GoldenPrompt:
    prompt: str
    tokens: tuple[int, ...]  # the greedy continuation, EOS ignored


@dataclass(frozen=True)
class ModelFacts:
    """What a contract pins about a model, read from its checkpoint (no weights loaded)."""

    architecture: str
    context_length: int
    rope_theta: float
    rope_scaling: str  # canonical JSON of the scaling, or "none"
    weight_types: tuple[str, ...]  # every storage type of its tensors, sorted
    tokenizer_sha256: str
    chat_template_sha256: str  # "" without a template

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> ModelFacts:
        config = checkpoint.config
        scaling = config.rope_scaling
        return cls(
            architecture=config.architecture,
            context_length=config.max_position_embeddings,
            rope_theta=float(config.rope_theta),
            rope_scaling="none"
            if scaling is None
            else json.dumps(vars(scaling), sort_keys=True, separators=(",", ":")),
            weight_types=tuple(sorted({t.storage for t in checkpoint.tensors.values()})),
            tokenizer_sha256=_sha256(checkpoint.tokenizer.backend_json()),
            chat_template_sha256=_sha256(checkpoint.chat_template)
            if checkpoint.chat_template
            else "",
        )


@dataclass(frozen=True)
class Contract:
    facts: ModelFacts
    rebar_versions: str  # a version specifier, e.g. ">=0.1,<0.2"
    golden: tuple[GoldenPrompt, ...]

    def to_toml(self) -> str:
        f = self.facts
        lines = [
            "# What rebar relies on about this model (rebar contract write / check).",
            f"format = {FORMAT}",
            f"rebar_versions = {json.dumps(self.rebar_versions)}",
            "",
            "[model]",
            f"architecture = {json.dumps(f.architecture)}",
            f"context_length = {f.context_length}",
            f"rope_theta = {f.rope_theta!r}",
            f"rope_scaling = {json.dumps(f.rope_scaling)}",
            f"weight_types = {json.dumps(list(f.weight_types))}",
            f"tokenizer_sha256 = {json.dumps(f.tokenizer_sha256)}",
            f"chat_template_sha256 = {json.dumps(f.chat_template_sha256)}",
        ]
        for golden in self.golden:
            lines += [
                "",
                "[[golden]]",
                f"prompt = {json.dumps(golden.prompt, ensure_ascii=False)}",
                f"tokens = {json.dumps(list(golden.tokens))}",
            ]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str, source: str = "contract") -> Contract:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ContractError(f"{source} is not valid TOML: {exc}") from exc
        try:
            if data.get("format") != FORMAT:
                raise ContractError(f"{source}: format {data.get('format')!r}, expected {FORMAT}")
            model = data["model"]
            facts = ModelFacts(
                architecture=_typed(model, "architecture", str),
                context_length=_typed(model, "context_length", int),
                rope_theta=float(_typed(model, "rope_theta", int | float)),
                rope_scaling=_typed(model, "rope_scaling", str),
                weight_types=tuple(_typed(model, "weight_types", list)),
                tokenizer_sha256=_typed(model, "tokenizer_sha256", str),
                chat_template_sha256=_typed(model, "chat_template_sha256", str),
            )
            golden = tuple(
                GoldenPrompt(_typed(g, "prompt", str), tuple(_typed(g, "tokens", list)))
                for g in data.get("golden", [])
            )
            versions = _typed(data, "rebar_versions", str)
            SpecifierSet(versions)
        except KeyError as exc:
            raise ContractError(f"{source} lacks {exc.args[0]!r}") from exc
        except InvalidSpecifier as exc:
            raise ContractError(f"{source}: rebar_versions is not a version range: {exc}") from exc
        if any(not g.tokens or not all(isinstance(t, int) for t in g.tokens) for g in golden):
            raise ContractError(f"{source}: every golden prompt needs a list of token ids")
        return cls(facts, versions, golden)

    @classmethod
    def read(cls, path: Path) -> Contract:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ContractError(f"cannot read the contract {path}: {exc}") from exc
        return cls.from_toml(text, str(path))


def _typed(table: dict[str, Any], key: str, kind: Any) -> Any:
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ContractError(f"contract field {key!r} has the wrong type: {value!r}")
    return value


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def contract_path(model_path: Path) -> Path:
    """Where a model's own contract lives: in its folder, or beside its file."""
    if model_path.is_dir():
        return model_path / CONTRACT_FILE
    return model_path.with_name(f"{model_path.stem}.{CONTRACT_FILE}")


def rebar_version() -> Version:
    return Version(importlib.metadata.version("rebar"))


def default_versions() -> str:
    """This rebar's minor series: `>=0.1.0,<0.2` for 0.1.x."""
    version = rebar_version()
    return f">={version.major}.{version.minor}.0,<{version.major}.{version.minor + 1}"


def golden_tokens(llm, prompt: str, count: int) -> tuple[int, ...]:
    """The greedy continuation of `prompt` (EOS ignored), as the contract records it."""
    core = llm.engine
    params = SamplingParams(max_tokens=count, temperature=0, ignore_eos=True)
    admitted = core.admit(prompt_token_ids(core.tokenizer, prompt), params)
    return tuple(run.complete(core, [admitted])[0].token_ids)


def record(
    llm,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    num_tokens: int = DEFAULT_GOLDEN_TOKENS,
    versions: str | None = None,
) -> Contract:
    """The contract `llm` (a loaded model: `rebar.LLM` or `rebar.engine.builder.LoadedModel`)
    meets now; an embedding model's has no golden
    prompts."""
    golden = (
        ()
        if llm.engine is None
        else tuple(GoldenPrompt(p, golden_tokens(llm, p, num_tokens)) for p in prompts)
    )
    return Contract(ModelFacts.of(llm.checkpoint), versions or default_versions(), golden)


def check(llm, contract: Contract) -> list[str]:
    """Every way `llm` breaks `contract` (empty: it meets it)."""
    problems = []
    if rebar_version() not in SpecifierSet(contract.rebar_versions):
        problems.append(
            f"rebar_versions: the contract wants {contract.rebar_versions}, "
            f"this is rebar {rebar_version()}"
        )
    have = ModelFacts.of(llm.checkpoint)
    for field in ModelFacts.__dataclass_fields__:
        want, got = getattr(contract.facts, field), getattr(have, field)
        if want != got:
            problems.append(
                f"{field}: the contract says {_shown(want)}, the model has {_shown(got)}"
            )
    if contract.golden and llm.engine is None:
        problems.append("golden: the contract has golden prompts; this model cannot generate")
        return problems
    for golden in contract.golden:
        got_tokens = golden_tokens(llm, golden.prompt, len(golden.tokens))
        if got_tokens != golden.tokens:
            problems.append(
                f"golden {golden.prompt!r}: expected tokens {list(golden.tokens)}, "
                f"the model gives {list(got_tokens)}"
            )
    return problems


def enforce(llm, contract: Contract, source: str) -> None:
    """Raise ContractError listing every mismatch when `llm` breaks `contract`."""
    problems = check(llm, contract)
    if problems:
        raise ContractError(
            f"{llm.checkpoint.path} breaks its contract {source}:\n  " + "\n  ".join(problems)
        )


def enforce_beside(llm) -> Path | None:
    """Check `llm` against the contract beside it, if there is one (raises ContractError when it
    breaks it); returns the contract's path, or None when it has none."""
    path = contract_path(llm.checkpoint.path)
    if not path.is_file():
        return None
    enforce(llm, Contract.read(path), str(path))
    logger.info("%s meets its contract %s", llm.checkpoint.path.name, path)
    return path


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return json.dumps(list(value))
    return json.dumps(value) if isinstance(value, str) else repr(value)
