"""The chat page in a real browser (Debian's Chromium, headless) against a live rebar on SmolLM2."""

from __future__ import annotations

import re
import time

import pytest
from chat_page_driver import GENERATION_TIMEOUT_MS, expect, metric, open_page
from web_tools import SCREENSHOT_DIR

from live_server import server_settings, serving_models
from suite_tiers import limit
from waiting import wait_until

pytestmark = limit("browser")  # tests/suite_tiers.py

STATS = re.compile(r"first token \d+\.\d\d s · \d+\.\d tokens/s · \d+ tokens")


@pytest.fixture(scope="module")
def chat_server(served_models):
    with serving_models(served_models, server_settings()) as (url, app):
        yield url, app


@pytest.fixture
def chat(chromium_browser, chat_server):
    url, _app = chat_server
    with open_page(chromium_browser, url) as page:
        page.wait_for_model()
        yield page


def test_answer_streams_in_token_by_token_and_survives_a_reload(chat, chat_server) -> None:
    # Enough tokens that the browser cannot fold them into two paints when the engine is fast.
    chat.settings(max_tokens=48)
    chat.record_answer_texts()
    with chat.page.expect_response("**/v1/chat/completions") as response_info:
        chat.send("What is the capital of France?")
    expect(chat.prompt).to_be_focused()
    expect(chat.prompt).to_have_value("")

    answer = chat.last_answer()
    expect(answer.locator(".note")).to_have_text(STATS, timeout=GENERATION_TIMEOUT_MS)
    final = answer.locator(".content").inner_text()
    assert final.strip()
    shown = [text for text in dict.fromkeys(chat.recorded_answer_texts()) if text]
    assert len(shown) >= 3, f"the answer did not arrive in pieces: {shown}"
    assert all(final.startswith(text) for text in shown), shown

    sent_id = response_info.value.request.headers["x-request-id"]
    assert re.fullmatch(r"web-[0-9a-f]{24}", sent_id)
    assert response_info.value.headers["x-request-id"] == sent_id

    # A phone-sized window shows everything without sideways scrolling.
    assert chat.page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    screenshot = SCREENSHOT_DIR / "chat-conversation.png"
    chat.page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 10_000

    chat.page.reload()
    expect(chat.page.locator("article.turn.user .content")).to_have_text(
        ["What is the capital of France?"]
    )
    expect(chat.last_answer().locator(".content")).to_have_text(final)
    expect(chat.last_answer().locator(".note")).to_have_text(STATS)


def test_stop_keeps_the_partial_answer_and_aborts_the_generation(chat, chat_server) -> None:
    url, _app = chat_server
    aborted_before = metric(url, "rebar_requests_finished_total", finish_reason="abort")
    chat.settings(max_tokens=400, temperature=0.8)
    chat.send("Write a long story about a dragon who learns to cook.")
    content = chat.last_answer().locator(".content")
    expect(content).to_have_text(re.compile(r"\S.{20,}", re.S), timeout=GENERATION_TIMEOUT_MS)
    expect(chat.stop_button).to_be_enabled()
    chat.stop_button.click()

    expect(chat.last_answer().locator(".note")).to_contain_text("stopped")
    expect(chat.status).to_have_text("Stopped.")
    partial = content.inner_text()
    assert len(partial) > 20
    expect(chat.prompt).to_be_focused()
    expect(chat.send_button).to_be_enabled()
    expect(chat.stop_button).to_be_disabled()

    # The server saw the disconnect: the request finished as aborted and nothing runs any more.
    assert wait_until(
        lambda: (
            metric(url, "rebar_requests_finished_total", finish_reason="abort")
            >= aborted_before + 1
        )
    ), "the server did not abort the generation"
    assert metric(url, "rebar_requests_running") == 0
    tokens = metric(url, "rebar_generation_tokens_total")
    time.sleep(0.5)
    assert metric(url, "rebar_generation_tokens_total") == tokens
    assert content.inner_text() == partial


def test_an_error_shows_the_request_id_the_server_logged(chat) -> None:
    chat.model.select_option("minilm")  # an embedding model: the server refuses to chat with it
    with chat.page.expect_response("**/v1/chat/completions") as response_info:
        chat.send("Hello")
    request_id = response_info.value.headers["x-request-id"]
    assert response_info.value.status == 400
    error = chat.last_answer().locator(".error")
    expect(error).to_contain_text("not served for generation")
    expect(error.locator(".request-id")).to_have_text(request_id)
    expect(chat.status).to_contain_text(request_id)
    expect(chat.send_button).to_be_enabled()
