"""The `rebar` command shortens libgomp's busy-wait before torch loads it and leaves a user's choice
alone; importing rebar as a library changes nothing in the process; the programs rebar starts to
compare against (llama.cpp's tools) get the environment without what rebar set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Records what libgomp will see: the environment at the moment torch (which loads libgomp) is
# imported. `rebar config show` imports no torch, so the probe imports it right after the command.
SPY = """
import builtins, os, sys
seen = {}
real_import = builtins.__import__
def spy(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules and "at_torch" not in seen:
        seen["at_torch"] = (os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
"""
THROUGH_THE_COMMAND = (
    SPY
    + """
import contextlib, io
import rebar.cli
assert "torch" not in sys.modules
with contextlib.redirect_stdout(io.StringIO()):
    rebar.cli.main(["config", "show"])
import torch
print(seen["at_torch"])
"""
)
AS_A_LIBRARY = (
    SPY
    + """
import rebar, rebar.llm
print(seen["at_torch"])
"""
)


def probe(script: str, **env: str) -> tuple:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", script],
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
def test_the_command_sets_the_spin_count_before_torch_loads(env, expected) -> None:
    assert probe(THROUGH_THE_COMMAND, **env) == expected


def test_importing_rebar_leaves_the_environment_alone() -> None:
    assert probe(AS_A_LIBRARY) == (None, None)


# What a program rebar starts sees (llama.cpp's tools, measured as their users run them).
PEER_ENV = """
import contextlib, io, os
import rebar.cli
with contextlib.redirect_stdout(io.StringIO()):
    rebar.cli.main(["config", "show"])
from rebar_bench.llamacpp import _run
child = _run(["sh", "-c", "echo ${GOMP_SPINCOUNT:-unset}"], 30).strip()
print((os.environ.get("GOMP_SPINCOUNT"), child))
"""


@pytest.mark.parametrize(
    ("env", "expected"), [({}, ("30000", "unset")), ({"GOMP_SPINCOUNT": "7"}, ("7", "7"))]
)
def test_llama_cpp_runs_without_the_spin_count_rebar_set_for_itself(env, expected) -> None:
    assert probe(PEER_ENV, **env) == expected
