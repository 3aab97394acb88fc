"""The chat page against a server with API keys and a one-request-per-minute limit: it asks for the
key, shows the 429 retry while it waits out Retry-After, and then answers."""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading

import pytest
from chat_page_driver import GENERATION_TIMEOUT_MS, expect, metric, open_page

from live_server import server_settings, serving_models
from suite_tiers import limit

pytestmark = limit("browser")  # tests/suite_tiers.py

API_KEY = "web-test-key"


@pytest.fixture(scope="module")
def limited_server(served_models):
    settings = server_settings(
        **{"server.api_keys": [API_KEY], "rate_limits.requests_per_minute": 1}
    )
    with serving_models(served_models, settings) as (url, app):
        yield url, app


def use_up_requests_until(app, seconds: float) -> None:
    """Spend the key's one request of a minute whose window closes in `seconds`, as if sent a minute
    ago.

    The counter is written where the rate limiter keeps it (`{prefix}:rl:{client}:req`, the client
    being the key's hash), so the server answers 429 with a Retry-After of about `seconds`.
    """
    client_id = "key-" + hashlib.sha256(API_KEY.encode()).hexdigest()[:32]
    store = app.state.rebar.store.inner  # the in-process MemoryStore
    write = store.set(f"rebar:rl:{client_id}:req", b"1", ttl_ms=int(seconds * 1000))
    # Playwright's sync API keeps an event loop running in this thread, so run it in another one.
    thread = threading.Thread(target=asyncio.run, args=(write,))
    thread.start()
    thread.join()


def test_rate_limited_request_retries_after_retry_after_and_succeeds(
    chromium_browser, limited_server
) -> None:
    url, app = limited_server
    with open_page(chromium_browser, url) as chat:
        expect(chat.status).to_contain_text("needs an API key")
        chat.settings(api_key=API_KEY, max_tokens=8)
        chat.wait_for_model()
        expect(chat.status).to_have_text("")

        use_up_requests_until(app, 2.5)
        chat.send("Say hello.")
        expect(chat.status).to_contain_text(
            re.compile(
                r"Rate limited \(request id web-[0-9a-f]+\); trying again in [1-3] s \(try 2 of 4\)"
            )
        )
        answer = chat.last_answer()
        expect(answer.locator(".note")).to_contain_text(
            "after 2 tries", timeout=GENERATION_TIMEOUT_MS
        )
        assert answer.locator(".content").inner_text().strip()
        expect(answer.locator(".error")).to_be_hidden()
        expect(chat.status).to_have_text("")

    assert metric(url, "rebar_rate_limited_total") == 1
    assert metric(url, "rebar_http_requests_total", route="/v1/chat/completions", status="429") == 1
    assert metric(url, "rebar_http_requests_total", route="/v1/chat/completions", status="200") == 1
