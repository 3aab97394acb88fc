"""What a test needs from its environment, and what happens when that is missing.

A missing dependency (a package, a bundled model, a binary, rebar's CPU kernels on a machine that
can build them) skips the test locally with the command that installs it; under CI (CI=true, set
by .ci/run) it fails the test with the same message, so a CI machine can never pass by skipping.

Hardware is different: a machine without a CPU feature cannot be given it by installing anything,
so `skip_for_hardware` and `requires_hardware` skip, CI included, and what the CPU has is asked of
the CPU itself (`/proc/cpuinfo`, else CPUID: rebar.kernels.cpu_quant.build.cpu_flags), never of
an environment variable. Under CI a hardware skip still fails the run as a whole
(tests/strict_ci.py): CI machines must have the hardware the suite tests.

This module is the only place in tests/ that may skip (tests/test_suite_rules.py enforces it).

`requires(check)` turns any of these checks into a marker; the hook in tests/conftest.py runs the
check before the test.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

MARKER = "requires"  # pytest.mark.requires(check): `check()` runs before the test


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def missing(what: str) -> NoReturn:
    """Skip (fail under CI) because `what` is absent: say what it is and how to install it."""
    if in_ci():
        pytest.fail(f"CI requires {what}", pytrace=False)
    pytest.skip(f"needs {what}", allow_module_level=True)  # also from a module's top level


def skip_for_hardware(reason: str) -> NoReturn:
    """Skip, CI included: this machine's hardware cannot run the test (no installation would help)."""
    pytest.skip(f"hardware: {reason}", allow_module_level=True)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def need_package(module: str, install: str) -> None:
    """Require the importable `module`; `install` is the command that provides it."""
    if not installed(module):
        missing(f"the {module} package: {install}")


def need_module(name: str, install: str = "pip install -e '.[test]'") -> ModuleType:
    """`name` imported; `pytest.importorskip` that fails under CI."""
    need_package(name, install)
    return importlib.import_module(name)


def need_binary(name: str, install: str) -> str:
    """The path of the executable `name` on PATH."""
    path = shutil.which(name)
    if path is None:
        missing(f"the {name} binary ({install})")
    return path


def need_desktop_window() -> None:
    """What `rebar desktop` and its tests need: pywebview, PyGObject with GTK 3 and WebKitGTK 4.1's
    introspection data, and Xvfb to give them a display."""
    need_binary("Xvfb", "make desktop")
    need_package("webview", "make desktop")
    need_package("gi", "make desktop")
    gi = importlib.import_module("gi")
    for namespace, version in (("Gtk", "3.0"), ("WebKit2", "4.1")):
        try:
            gi.require_version(namespace, version)
        except ValueError:
            missing(f"{namespace} {version} introspection data (make desktop)")


def need_cpu_features(flags: set[str], what: str) -> None:
    """A hardware skip unless the CPU itself reports every one of `flags` (/proc/cpuinfo names)."""
    from rebar.kernels.cpu_quant.build import cpu_flags

    lacking = flags - cpu_flags()
    if lacking:
        skip_for_hardware(f"{what}: this CPU lacks {', '.join(sorted(lacking))}")


def need_cpu_kernels() -> None:
    """rebar's CPU quantized kernels: built here, unless the CPU lacks AVX2 (a hardware skip).

    On a CPU with AVX2, FMA and F16C (asked of the CPU, not of /proc/cpuinfo alone) a kernel that
    is not built is a missing dependency: a compiler, ninja, or REBAR_DISABLE_CPU_KERNELS left set.
    """
    from rebar.kernels import cpu_quant
    from rebar.kernels.cpu_quant.build import load_extension

    if cpu_quant.available():
        return
    reason = load_extension().reason
    need_cpu_features(
        {"avx2", "fma", "f16c"}, f"rebar's CPU kernels need AVX2, FMA and F16C ({reason})"
    )
    missing(f"rebar's CPU kernels on this AVX2 machine: {reason}")


def need_linux_proc() -> None:
    """A hardware (platform) skip off Linux: the test reads /proc/self."""
    if not Path("/proc/self/maps").exists():
        skip_for_hardware("needs Linux /proc")


def relay_skip(message: str) -> NoReturn:
    """Skip as a subprocess run of the same test did (its skip came from a check in this module,
    and under CI that check fails instead)."""
    pytest.skip(message)


def requires(check: Callable[[], object]) -> pytest.MarkDecorator:
    """A marker that runs `check` (one of the functions above, or one built on them) before the
    test."""
    return getattr(pytest.mark, MARKER).with_args(check)  # with_args: check is itself callable


def requires_hardware(condition: bool, reason: str) -> pytest.MarkDecorator:
    """A marker that skips the test, CI included, unless the hardware meets `condition`."""
    return pytest.mark.skipif(not condition, reason=f"hardware: {reason}")


def run_required_checks(item: pytest.Item) -> None:
    """The `pytest_runtest_setup` body: every `requires` check of `item`, outermost first."""
    for mark in reversed(list(item.iter_markers(MARKER))):
        (check,) = mark.args
        check()
