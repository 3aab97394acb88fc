"""A live rebar server on the bundled models, shared by the server tests of a module."""

from __future__ import annotations

import pytest

from live_server import server_settings, serving_models

__all__ = ["server_settings"]  # imported by test modules as `from conftest import server_settings`


@pytest.fixture(scope="module")
def server(served_models):
    """(base_url, app) of a server on the shared models; the engine thread stops with the module."""
    with serving_models(served_models, server_settings()) as (url, app):
        yield url, app
