"""Running Triton kernel modules on Triton's CPU interpreter from the test process.

Triton fixes interpreted-or-compiled per function when the function is defined, from
TRITON_INTERPRET: its own library functions (`tl.sum`, `tl.cdiv`, ...) when `triton` is first
imported, our kernels when their module is imported. Both must agree, so the variable is set
before the first `import triton` and left set (unsetting it later breaks Triton's lazily imported
parts).

Something else may import Triton first, compiled: `torch._dynamo` does on import whenever Triton
is installed, and many torch code paths import it lazily. Then the interpreter cannot be switched
on in this process any more, and a test file that needs it runs whole in a subprocess with the
variable set; `conftest.py` reports each test's outcome from that run.

Without Triton the tests skip with the install command; under CI=true they fail instead.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from types import ModuleType

from needs import need_package

INSTALL = "pip install --no-deps triton==3.9.0"


def require_triton() -> None:
    need_package("triton", INSTALL)


def interpreter_available() -> bool:
    """True unless Triton is already imported here in compiled mode."""
    triton = sys.modules.get("triton")
    return triton is None or bool(triton.knobs.runtime.interpret)


def import_interpreted(module_name: str) -> ModuleType | None:
    """`module_name` with its kernels interpreted, or None when only a subprocess can do that."""
    require_triton()
    if not interpreter_available():
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    # A copy imported while the variable was unset has compiled kernels: import it afresh.
    sys.modules.pop(module_name, None)
    return importlib.import_module(module_name)


_CHILD_FLAG = "REBAR_TEST_INTERPRETER_CHILD"


@functools.cache  # one run per test file, however many of its tests ask
def subprocess_outcomes(test_file: Path) -> dict[str, tuple[str, str]]:
    """Run `test_file` under the interpreter in a fresh process: test name -> (outcome, message).

    Outcomes are "passed", "failed" or "skipped"; a test missing from the result is absent.
    """
    if os.environ.get(_CHILD_FLAG):  # already the subprocess: never spawn another
        return {"": ("failed", "Triton could not interpret even in a fresh process")}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(test_file)
        ]  # fmt: skip
        env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_FLAG: "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if not report.exists():
            return {
                "": (
                    "failed",
                    f"the subprocess wrote no report:\n{(done.stdout + done.stderr)[-4000:]}",
                )
            }
        return _parse_junit(report)


def _parse_junit(report: Path) -> dict[str, tuple[str, str]]:
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", f"{child.get('message', '')}\n{child.text or ''}"
            elif child.tag == "skipped":
                outcome, message = "skipped", child.get("message", "")
        outcomes[case.get("name", "")] = (outcome, message)
    return outcomes
