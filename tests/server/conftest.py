"""A live rebar server on the bundled models, shared by the server tests of a module."""

from __future__ import annotations

import pytest

from live_server import server_settings, serving_models
from needs import need_module

__all__ = ["server_settings"]  # imported by test modules as `from conftest import server_settings`


@pytest.fixture(scope="module")
def server(served_models):
    """(base_url, app) of a server on the shared models; the engine thread stops with the module."""
    with serving_models(served_models, server_settings()) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    """The official `openai` SDK pointed at the module's server (no retries: a failure shows)."""
    openai = need_module("openai")
    url, _ = server
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as sdk:
        yield sdk
