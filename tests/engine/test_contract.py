"""Model contracts (rebar.engine.contract): recorded from a model, read back, checked field by
field with every mismatch named, enforced at load, and driven by `rebar contract write | check`;
the bundled models meet the contracts kept in contracts/."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from hf_tiny import build_decoder, save_decoder

from markers import need_gemma3, need_minilm, need_smollm2
from rebar.cli import main
from rebar.engine.contract import (
    CONTRACT_FILE,
    Contract,
    ContractError,
    GoldenPrompt,
    check,
    contract_path,
    enforce_beside,
    record,
)
from rebar.llm import LLM

CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_decoder(build_decoder("LlamaForCausalLM", seed=5), tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu")


@pytest.fixture(scope="module")
def recorded(llm):
    return record(llm, ["5 9 11", "hello"], num_tokens=4)


def test_a_recorded_contract_reads_back_and_is_met(llm, recorded) -> None:
    assert Contract.from_toml(recorded.to_toml()) == recorded
    assert recorded.facts.architecture == "llama" and len(recorded.golden) == 2
    assert all(len(g.tokens) == 4 for g in recorded.golden)
    assert check(llm, recorded) == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"architecture": "gemma3"}, "architecture"),
        ({"context_length": 99}, "context_length"),
        ({"rope_theta": 1.0}, "rope_theta"),
        ({"rope_scaling": '{"kind":"linear"}'}, "rope_scaling"),
        ({"weight_types": ("Q4_K",)}, "weight_types"),
        ({"tokenizer_sha256": "0" * 64}, "tokenizer_sha256"),
        ({"chat_template_sha256": "1" * 64}, "chat_template_sha256"),
    ],
)
def test_each_changed_fact_is_named_with_both_values(llm, recorded, change, field) -> None:
    broken = dataclasses.replace(recorded, facts=dataclasses.replace(recorded.facts, **change))
    problems = check(llm, broken)
    assert len(problems) == 1 and problems[0].startswith(f"{field}: the contract says")
    value = next(iter(change.values()))
    shown = value[0] if isinstance(value, tuple) else str(value)
    assert shown.replace('"', "")[:5] in problems[0].replace("\\", "").replace('"', "")


def test_golden_tokens_and_versions_are_checked(llm, recorded) -> None:
    wrong = GoldenPrompt(recorded.golden[0].prompt, tuple(t + 1 for t in recorded.golden[0].tokens))
    broken = dataclasses.replace(recorded, golden=(wrong,), rebar_versions=">=9")
    problems = check(llm, broken)
    assert any(p.startswith("rebar_versions: the contract wants >=9") for p in problems)
    assert any(p.startswith("golden '5 9 11': expected tokens") for p in problems)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("format = 1\n[model", "not valid TOML"),
        ('format = 2\nrebar_versions = ">=0"\n[model]\n', "format 2"),
        ('format = 1\nrebar_versions = ">=0"\n', "lacks 'model'"),
        ("", "format None"),
    ],
)
def test_unreadable_contracts_say_why(text, says) -> None:
    with pytest.raises(ContractError, match=says):
        Contract.from_toml(text)


def test_wrong_types_and_version_ranges_are_refused(recorded) -> None:
    good = recorded.to_toml()
    with pytest.raises(ContractError, match="context_length"):
        Contract.from_toml(good.replace("context_length = ", 'context_length = "x" #'))
    with pytest.raises(ContractError, match="version range"):
        Contract.from_toml(good.replace(recorded.rebar_versions, "about 0.1"))
    with pytest.raises(ContractError, match="token ids"):
        Contract.from_toml(good.replace("tokens = [", 'tokens = ["a", '))


def test_a_contract_beside_the_model_is_enforced_at_load(
    tmp_path, model_dir, llm, recorded
) -> None:
    assert contract_path(model_dir) == model_dir / CONTRACT_FILE
    assert contract_path(Path("/m/model.gguf")) == Path("/m/model.rebar-contract.toml")
    assert enforce_beside(llm) is None  # no contract: nothing to check
    path = contract_path(model_dir)
    try:
        path.write_text(recorded.to_toml())
        assert enforce_beside(llm) == path
        broken = dataclasses.replace(
            recorded, facts=dataclasses.replace(recorded.facts, context_length=7)
        )
        path.write_text(broken.to_toml())
        with pytest.raises(ContractError, match="context_length: the contract says 7"):
            enforce_beside(llm)
        from rebar.config.settings import Settings
        from rebar.server.app import load_models

        settings = Settings.model_validate(
            {"models": {"chat": str(model_dir), "embedding": None, "device": "cpu"}}
        )
        with pytest.raises(ContractError, match="breaks its contract"):
            load_models(settings)
    finally:
        path.unlink(missing_ok=True)


def test_the_command_line_writes_and_checks(tmp_path, model_dir, capsys, caplog) -> None:
    caplog.set_level(logging.WARNING)
    out = tmp_path / "c.toml"
    model = ["--model", str(model_dir), "--device", "cpu"]
    assert main(["contract", "write", *model, "--contract", str(out), "--tokens", "3"]) == 0
    assert main(["contract", "write", *model, "--contract", str(out)]) == 2  # exists: not replaced
    assert main(["contract", "check", *model, "--contract", str(out)]) == 0
    assert "meets its contract" in capsys.readouterr().out
    out.write_text(out.read_text().replace('architecture = "llama"', 'architecture = "phi3"'))
    assert main(["contract", "check", *model, "--contract", str(out)]) == 1
    printed = capsys.readouterr().out
    assert 'mismatch: architecture: the contract says "phi3", the model has "llama"' in printed
    assert "breaks its contract" in printed


@pytest.mark.parametrize(
    ("alias", "need"), [("smollm2", need_smollm2), ("gemma3", need_gemma3), ("minilm", need_minilm)]
)
def test_the_bundled_models_meet_their_contracts(alias, need) -> None:
    need()
    llm = LLM(alias, device="cpu")
    contract = Contract.read(CONTRACTS / f"{alias}.{CONTRACT_FILE}")
    assert check(llm, contract) == []
    assert bool(contract.golden) == (llm.engine is not None)
