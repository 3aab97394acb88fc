"""Fixtures for the chat page's tests: Node.js with web/'s packages, and a headless Chromium."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
from web_tools import CHROMIUM, WEB_DIR, missing_tool


@pytest.fixture(scope="session")
def npm() -> str:
    """The npm executable, with web/'s locked packages installed."""
    npm_path = shutil.which("npm")
    if shutil.which("node") is None or npm_path is None:
        missing_tool("Node.js 20+ and npm (apt-get install -y nodejs npm)")
    if not (WEB_DIR / "node_modules" / ".package-lock.json").exists():
        missing_tool("web/'s packages (npm --prefix web ci)")
    return npm_path


@pytest.fixture(scope="module")
def chromium_browser():
    """A headless Debian Chromium driven by Playwright, shared by one file's browser tests.

    Per file, not per session: Playwright's synchronous API keeps an asyncio loop marked running
    in this thread while it is open, and every later test of the same process that calls
    asyncio.run would fail."""
    if not CHROMIUM.exists():
        missing_tool("Chromium at /usr/bin/chromium (apt-get install -y chromium)")
    if importlib.util.find_spec("playwright") is None:
        missing_tool("the playwright package (pip install -e '.[test]')")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield browser
        finally:
            browser.close()
