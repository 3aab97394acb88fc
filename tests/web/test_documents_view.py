"""The chat page's Documents view in a real browser (Debian's Chromium, headless) against a live
rebar on SmolLM2: a PDF opened through the file input, progress per chunk, the summary with page
references, then a question about it in the chat."""

from __future__ import annotations

import json
import re

import pytest
from chat_page_driver import GENERATION_TIMEOUT_MS, expect, open_page
from tests.documents.files import pdf_bytes
from web_tools import SCREENSHOT_DIR

from live_server import assert_idle, server_settings, serving_models
from rebar.documents.attribution import content_words
from rebar_bench.sample_document import CHAPTERS
from suite_tiers import limit

pytestmark = limit("browser")

PAGES = list(CHAPTERS[1][1])  # the queen: four pages


@pytest.fixture(scope="module")
def documents_server(served_models):
    settings = server_settings(
        **{
            "documents.max_chunk_tokens": 200,
            "documents.summary_tokens": 40,
            "documents.final_tokens": 60,
        }
    )
    with serving_models(served_models, settings) as (url, app):
        yield url, app


def test_a_document_summarised_in_the_page_then_asked_about(
    chromium_browser, documents_server, tmp_path
) -> None:
    url, app = documents_server
    path = tmp_path / "queen.pdf"
    path.write_bytes(pdf_bytes(PAGES))
    with open_page(chromium_browser, url) as chat:
        chat.wait_for_model()
        page = chat.page
        page.locator("details#documents summary").click()
        page.get_by_label("Document (PDF").set_input_files(str(path))
        page.get_by_label("Style").select_option("key_points")
        progress_seen: list[str] = []

        def note_progress(text: str) -> None:
            progress_seen.append(text)

        page.expose_function("noteProgress", note_progress)
        page.evaluate(
            """() => new MutationObserver(() => window.noteProgress(
                   document.getElementById('document-progress').textContent))
               .observe(document.getElementById('document-progress'), {childList: true, characterData: true, subtree: true})"""
        )
        page.get_by_role("button", name="Summarize").click()
        progress = page.locator("#document-progress")
        expect(progress).to_have_text("queen.pdf: done", timeout=GENERATION_TIMEOUT_MS)
        # chunks batched together finish in the same step: the page may show only the last of them
        assert any(re.search(r": chunk \d+/\d+ \(pp?\. ", text) for text in progress_seen), (
            progress_seen
        )
        statements = page.locator("#document-summary .statement")
        assert statements.count() >= 1
        # Each statement shows its pages, or that none supports it (which pages the small model's
        # sentences get varies with the engine's state; the API and CLI tests count them).
        for item in statements.all():
            text = item.locator("span").first.inner_text()
            ref = item.locator(".pages").inner_text().strip()
            assert re.fullmatch(r"\[(pp?\. \d+(, \d+)*|no source found)\]", ref), ref
            if ref.startswith("[p"):
                for number in ref.strip("[]").split(" ", 1)[1].split(", "):
                    assert content_words(text) & content_words(PAGES[int(number) - 1]), (text, ref)
        SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT_DIR / "documents-view.png"), full_page=True)

        page.get_by_role("button", name="Ask about it in the chat").click()
        system_prompt = page.get_by_label("System prompt", exact=True)
        expect(system_prompt).to_have_value(
            re.compile(r'^You answer questions about the document "queen\.pdf"')
        )
        expect(chat.prompt).to_be_focused()
        chat.settings(max_tokens=8)
        with page.expect_request("**/v1/chat/completions") as request_info:
            chat.send("Who lays the eggs?")
        messages = json.loads(request_info.value.post_data or "{}")["messages"]
        assert messages[0]["role"] == "system" and "queen.pdf" in messages[0]["content"]
        assert statements.first.locator("span").first.inner_text() in messages[0]["content"]
        answer = chat.last_answer()
        expect(answer.locator(".note")).to_have_text(
            re.compile("tokens"), timeout=GENERATION_TIMEOUT_MS
        )
    assert_idle(app)
