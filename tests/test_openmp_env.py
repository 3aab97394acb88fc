"""rebar shortens libgomp's busy-wait before torch loads it, and leaves a user's choice alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Records what libgomp will see: the environment at the moment torch (which loads libgomp) is imported.
PROBE = """
import builtins, os, sys
seen = {}
real_import = builtins.__import__
def spy(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules and "at_torch" not in seen:
        seen["at_torch"] = (os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
import rebar.engine.llm
print(seen["at_torch"])
"""


def probe(**env: str) -> tuple:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ("30000", None)),
        ({"GOMP_SPINCOUNT": "7"}, ("7", None)),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, (None, "ACTIVE")),
    ],
)
def test_spin_count_is_set_before_torch_loads(env, expected):
    assert probe(**env) == expected
