"""Paths of the chat page's sources and build, and how its tests treat a missing tool.

A missing tool skips its tests with the command that installs it; under CI (CI=true, set by
.ci/run) it fails them instead, so a CI machine without the tool can never pass by skipping.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

from needs import missing

REPO = Path(__file__).resolve().parents[2]
WEB_DIR = REPO / "web"
STATIC_DIR = REPO / "src" / "rebar" / "web" / "static"
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT_DIR = Path(os.environ.get("REBAR_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))


def missing_tool(message: str) -> NoReturn:
    missing(message)
