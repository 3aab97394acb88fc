"""The suite's own rules: the fast tier cannot drift (tests/suite_tiers.py), every test has a time
limit (pytest-timeout), and pytest runs with both."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

import suite_tiers

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
RECORDED: dict[str, float] = json.loads((TESTS / "durations.json").read_text())
TEST_FILES = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))
MEASURE = (
    "measure it: flock -x /tmp/rebar-cpu.lock .venv/bin/python -m pytest FILES "
    "--junitxml=/tmp/suite.xml && .venv/bin/python scripts/suite_durations.py /tmp/suite.xml"
)


def test_every_test_file_has_a_recorded_cost() -> None:
    unmeasured = [name for name in TEST_FILES if name not in RECORDED]
    assert not unmeasured, f"no recorded duration for {unmeasured}: {MEASURE}"
    gone = [name for name in RECORDED if name not in TEST_FILES]
    assert not gone, f"tests/durations.json lists files that are gone: {gone}"


def test_slow_files_are_full_only() -> None:
    slow = {
        name: seconds
        for name, seconds in RECORDED.items()
        if seconds > suite_tiers.SLOW_FILE_S and not suite_tiers.is_full_only(name)
    }
    assert not slow, f"slower than {suite_tiers.SLOW_FILE_S} s but in the fast tier: {slow}"


def test_the_fast_tier_fits_its_budget() -> None:
    fast = sum(s for name, s in RECORDED.items() if not suite_tiers.is_full_only(name))
    assert fast <= suite_tiers.FAST_BUDGET_S, f"the fast tier costs {fast:.0f} s"
    # ... and it is most of the suite by count: the fast tier is the one run while developing.
    fast_files = [name for name in TEST_FILES if not suite_tiers.is_full_only(name)]
    assert len(fast_files) > len(TEST_FILES) / 2


def test_every_full_only_entry_names_tests_that_exist() -> None:
    for entry in suite_tiers.FULL_ONLY:
        assert any(suite_tiers.is_full_only(name) for name in TEST_FILES if entry in name), entry
        assert (TESTS / entry).exists(), entry


@pytest.mark.parametrize(
    ("path", "full"),
    [
        ("reliability/test_soak.py", True),
        ("quant/test_awq.py", True),
        ("quant/test_quantize.py", False),
        ("reliabilityx/test_a.py", False),
        ("test_config.py", False),
    ],
)
def test_tiers_match_whole_names_and_folders(path: str, full: bool) -> None:
    assert suite_tiers.is_full_only(path) == full


def pytest_options() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def test_every_test_has_a_time_limit(request: pytest.FixtureRequest) -> None:
    options = pytest_options()
    assert int(options["timeout"]) == suite_tiers.DEFAULT_LIMIT_S
    assert request.config.getini("timeout") == str(suite_tiers.DEFAULT_LIMIT_S)
    assert request.config.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("pytest-timeout==") for d in extras["optional-dependencies"]["test"])
    assert all(seconds > suite_tiers.DEFAULT_LIMIT_S for seconds in suite_tiers.LIMITS_S.values())


pytest_plugins = ["pytester"]


def test_a_hanging_test_fails_at_its_limit_with_the_stack(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the suite's helper modules, as in the suite
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(
        test_hang="""
import threading

def wait_forever():
    threading.Event().wait()

def test_hangs():
    wait_forever()
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "timeout=2")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "Timeout" in out and "wait_forever" in out  # the stack says where it hung
