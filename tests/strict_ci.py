"""Under CI (CI=true, set by .ci/run) a run that skipped or xfailed anything fails.

A skipped test is an untested capability whatever the reason, so a green CI run must have run
everything: `SkipsFailCi` collects every skipped or xfailed report (tests, setups and whole
modules skipped at collection), lists them at the end and sets the exit status to "tests failed".
Locally nothing changes: skips stay skips, with the reason pytest's `-ra` shows.

tests/conftest.py registers it for every run of the suite.
"""

from __future__ import annotations

import pytest

from needs import in_ci


def describe(report: pytest.TestReport | pytest.CollectReport) -> str:
    """`nodeid: reason` of a skipped or xfailed report."""
    if hasattr(report, "wasxfail"):
        return f"{report.nodeid}: xfailed: {report.wasxfail or 'no reason given'}"
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return f"{report.nodeid}: {reason.removeprefix('Skipped: ')}"


class SkipsFailCi:
    """The plugin: one per pytest run, so a run inside a test (pytester) keeps its own list."""

    def __init__(self) -> None:
        self.skips: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped:  # xfailed tests report as skipped too
            self.skips.append(describe(report))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:  # a module skipped as a whole
            self.skips.append(describe(report))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        passing = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if in_ci() and self.skips and exitstatus in passing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not (in_ci() and self.skips):
            return
        terminalreporter.section("skipped under CI=true: the run fails", red=True, bold=True)
        for line in self.skips:
            terminalreporter.line(line)
        terminalreporter.line(
            f"{len(self.skips)} skipped or xfailed: under CI every test must run "
            "(tests/strict_ci.py)",
            red=True,
        )


def register(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipsFailCi(), "rebar-skips-fail-ci")
