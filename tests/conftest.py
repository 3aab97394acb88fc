"""Shared fixtures (the bundled models, loaded once per session), the `requires` marker's hook and
the suite's rules for every run.

A missing model package skips the tests that need it locally and fails them under CI=true
(tests/needs.py); under CI=true any skip or xfail fails the run (tests/strict_ci.py). tests/model's
tiny-GGUF builders are importable from every test folder.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import hypothesis
import pytest

import strict_ci
import suite_tiers
from markers import need_gemma3, need_minilm, need_smollm2
from needs import MARKER, run_required_checks

# Property tests and fuzzers draw the same cases on every run (CI and `make test`), so a failure
# is reproducible and a green run means the same thing twice; `make reliability` draws new random
# cases (REBAR_HYPOTHESIS_PROFILE=random) and keeps the failing ones in .hypothesis/.
hypothesis.settings.register_profile("derandomized", derandomize=True, print_blob=True)
hypothesis.settings.register_profile("random", print_blob=True)
hypothesis.settings.load_profile(os.environ.get("REBAR_HYPOTHESIS_PROFILE", "derandomized"))

MODEL_TEST_HELPERS = str(Path(__file__).resolve().parent / "model")
if MODEL_TEST_HELPERS not in sys.path:
    sys.path.append(MODEL_TEST_HELPERS)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(check): run check() before the test (tests/needs.py)"
    )
    config.addinivalue_line(
        "markers", f"{suite_tiers.MARKER}: only the full suite runs it (tests/suite_tiers.py)"
    )
    strict_ci.register(config)


TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the full-only tests (tests/suite_tiers.py), which `make check` leaves out."""
    for item in items:
        path = Path(item.path)
        if path.is_relative_to(TESTS) and suite_tiers.is_full_only(
            path.relative_to(TESTS).as_posix()
        ):
            item.add_marker(suite_tiers.MARKER)


def pytest_runtest_setup(item: pytest.Item) -> None:
    run_required_checks(item)


@pytest.fixture(scope="module", autouse=True)
def no_event_loop_left_running():
    """A test file must not leave an asyncio loop marked running in the main thread (Playwright's
    synchronous API does while it is open): every later asyncio.run of the process would fail."""
    yield
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # none: the normal case
    pytest.fail("this file left an asyncio event loop running in the main thread")


@pytest.fixture(scope="session")
def smollm2():
    need_smollm2()
    from rebar import LLM

    return LLM(model="smollm2", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    need_smollm2()
    from rebar.model.loader import open_checkpoint

    return open_checkpoint("smollm2").tokenizer


@pytest.fixture(scope="session")
def gemma3():
    need_gemma3()
    from rebar import LLM

    return LLM(model="gemma3", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def gemma3_tokenizer():
    need_gemma3()
    from rebar.model.loader import open_checkpoint

    return open_checkpoint("gemma3").tokenizer


@pytest.fixture(scope="session")
def minilm():
    need_minilm()
    from rebar import LLM

    return LLM(model="minilm", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def served_models():
    """The server's chat and embedding models, loaded once for every live-server test of the
    session."""
    need_smollm2()
    need_minilm()
    from live_server import server_settings
    from rebar.server.app import load_models

    return load_models(server_settings())
