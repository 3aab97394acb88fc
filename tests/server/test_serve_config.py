"""How `rebar serve` configures uvicorn: the guarded protocol, limits, proxies and the file limit."""

from __future__ import annotations

import resource

from rebar.config import load_settings
from rebar.server.serve import GuardedH11Protocol, raise_file_limit, uvicorn_config


def config_for(**overrides):
    settings = load_settings(None, overrides)
    return uvicorn_config(object(), settings.server)  # type: ignore[arg-type]


def test_defaults_guard_connections_and_trust_no_proxy() -> None:
    config = config_for()
    assert config.http.func is GuardedH11Protocol and config.http.keywords == {
        "header_timeout_s": 15.0
    }
    assert config.limit_concurrency == 1024
    assert config.proxy_headers is False  # uvicorn's own default would believe 127.0.0.1
    assert config.timeout_graceful_shutdown == 30


def test_settings_reach_uvicorn() -> None:
    config = config_for(
        **{
            "server.max_connections": 10,
            "server.header_timeout_s": 2.5,
            "server.trusted_proxies": ["10.0.0.5", "10.0.0.6"],
            "server.drain_timeout_s": 7,
        }
    )
    assert config.limit_concurrency == 10 and config.http.keywords == {"header_timeout_s": 2.5}
    assert config.proxy_headers is True and config.forwarded_allow_ips == ["10.0.0.5", "10.0.0.6"]
    assert config.timeout_graceful_shutdown == 7


def test_file_limit_is_raised_towards_what_connections_need_never_past_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(300, hard), hard))
        assert raise_file_limit(500) == min(500 + 256, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(756, hard)
        assert raise_file_limit(10) == min(756, hard)  # never lowered
        if hard != resource.RLIM_INFINITY:
            assert raise_file_limit(hard * 2) == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
