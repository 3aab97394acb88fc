"""Building a model must not pull in torch's compiler stack (torch._dynamo, and Triton with it).

Both are imported by torch's Python decompositions when a random init runs on a meta tensor, which
cost every start about 1.7 s and 67 MiB for values the checkpoint then replaces. Checked in a fresh
interpreter, since other tests import them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys
import torch
from rebar.model import uninitialized
from rebar.model.llama import LlamaModel
from tests.tiny_engine import tiny_config

with torch.device("meta"):
    model = LlamaModel(tiny_config())
    uninitialized.embedding(30, 8)  # as BERT's three embeddings are built
assert model.embed_tokens.weight.is_meta
print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""


def imported_after(code: str) -> str:
    """The last line `code` prints, run in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_building_on_the_meta_device_imports_no_compiler() -> None:
    assert imported_after(CHILD) == "[]"


def test_the_same_check_sees_the_import_when_nn_embedding_initialises() -> None:
    """The check itself can fail: a plain nn.Embedding built on meta does import torch._dynamo."""
    child = CHILD.replace("uninitialized.embedding(30, 8)", "torch.nn.Embedding(30, 8)")
    assert "torch._dynamo" in imported_after(child)
