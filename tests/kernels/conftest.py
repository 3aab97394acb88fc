"""Tests that take a `kernels` fixture run Triton kernels on Triton's CPU interpreter.

When this process cannot interpret Triton any more (see interpreted_triton.py), the fixture is
None and such a test reports the outcome of the same test from a subprocess run of its file.
"""

from __future__ import annotations

import pytest
from interpreted_triton import subprocess_outcomes

from needs import relay_skip


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if "kernels" not in pyfuncitem.fixturenames or pyfuncitem.funcargs["kernels"] is not None:
        return None  # run here as usual
    outcomes = subprocess_outcomes(pyfuncitem.path)
    no_result = outcomes.get("", ("failed", "the subprocess run did not report this test"))
    outcome, message = outcomes.get(pyfuncitem.name, no_result)
    if outcome == "failed":
        pytest.fail(f"failed under the interpreter in a subprocess:\n{message}", pytrace=False)
    if outcome == "skipped":
        relay_skip(message)
    return True  # passed in the subprocess
