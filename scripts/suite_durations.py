"""Record what each test file of the suite costs (tests/durations.json, tests/suite_tiers.py).

Run the suite (or some files of it) under the exclusive CPU lock with a JUnit report, then merge
the per-file seconds (setup and teardown of their fixtures included, as pytest reports them) into
tests/durations.json:

    flock -x /tmp/rebar-cpu.lock .venv/bin/python -m pytest -q tests --junitxml=/tmp/suite.xml
    .venv/bin/python scripts/suite_durations.py /tmp/suite.xml

Also prints the slowest tests of the report, which is where the per-test time limits come from.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"


def file_of(case: ElementTree.Element) -> str:
    """The test file of a JUnit test case, relative to tests/ ("server/test_api.py")."""
    module = case.get("classname", "").split(".")
    parts = module[1:] if module and module[0] == "tests" else module
    while parts and not parts[-1].startswith("test_"):
        parts = parts[:-1]  # a test class inside the module
    return "/".join(parts) + ".py"


def per_file(report: Path) -> tuple[dict[str, float], list[tuple[float, str]]]:
    seconds: dict[str, float] = defaultdict(float)
    tests = []
    for case in ElementTree.parse(report).iter("testcase"):
        took = float(case.get("time", 0))
        seconds[file_of(case)] += took
        tests.append((took, f"{case.get('classname')}::{case.get('name')}"))
    return dict(seconds), sorted(tests, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--slowest", type=int, default=25)
    args = parser.parse_args()
    measured, tests = per_file(args.junit_xml)
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    merged = {name: round(s, 1) for name, s in (recorded | measured).items()}
    live = {n: s for n, s in sorted(merged.items()) if (ROOT / "tests" / n).exists()}
    DURATIONS.write_text(json.dumps(live, indent=1) + "\n")
    print(f"{len(measured)} files measured, {len(live)} recorded in {DURATIONS.relative_to(ROOT)}")
    for took, name in tests[: args.slowest]:
        print(f"{took:8.1f} s  {name}")


if __name__ == "__main__":
    main()
