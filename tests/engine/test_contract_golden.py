"""The bundled models' contracts take their golden tokens from llama.cpp, not from rebar.

Each golden prompt of contracts/smollm2 and contracts/gemma3 is a plain-text case of the llama.cpp
greedy fixtures (tests/fixtures/*_llamacpp_greedy.json, made by llama.cpp's own server from the
same GGUF files), and its tokens are the first tokens of llama.cpp's continuation: a contract
check (tests/engine/test_contract.py) then holds rebar to an independent reference.

Of the fixtures' four plain-text prompts, rebar (as `LLM(alias)` loads it) continues one exactly as
llama.cpp does for SmolLM2 and three for Gemma 3; the contracts keep those. The others part from
llama.cpp within the first eight tokens (SmolLM2: "The quick brown fox..." and "def fibonacci..."
at token 2, "Once upon a time..." at token 5; Gemma 3: "Once upon a time..." at token 3), at
near-ties of rebar's own logits as test_smollm2_vs_llamacpp.py and test_gemma3_vs_llamacpp.py
check, so they cannot be golden tokens for both engines.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("alias", ["smollm2", "gemma3"])
def test_contract_golden_tokens_are_llamacpps_greedy_continuations(alias: str) -> None:
    fixture = json.loads(
        (ROOT / "tests" / "fixtures" / f"{alias}_llamacpp_greedy.json").read_text()
    )
    llamacpp = {case["text"]: case["greedy_ids"] for case in fixture["cases"]}
    contract = tomllib.loads((ROOT / "contracts" / f"{alias}.rebar-contract.toml").read_text())
    golden = contract["golden"]
    assert golden, "the contract keeps golden prompts"
    for case in golden:
        assert case["prompt"] in llamacpp, f"{case['prompt']!r} is not a llama.cpp fixture case"
        expected = llamacpp[case["prompt"]][: len(case["tokens"])]
        assert case["tokens"] == expected, case["prompt"]
