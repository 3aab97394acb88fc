"""Drive the chat page the way a user does (by labels and button names), and read the server's
metrics."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

PHONE = {"width": 390, "height": 844}
GENERATION_TIMEOUT_MS = 90_000  # a shared 2-core machine can be slow


def expect(actual, message: str | None = None):
    """Playwright's `expect`, imported on first use so that test modules load (and skip) without
    Playwright."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(actual, message)


@contextmanager
def open_page(browser: Browser, url: str):
    """A fresh browser context (empty local storage) on a phone-sized window, at the chat page."""
    context = browser.new_context(viewport=PHONE)
    try:
        page = context.new_page()
        page.goto(url + "/")
        yield ChatPage(page)
    finally:
        context.close()


class ChatPage:
    def __init__(self, page: Page) -> None:
        self.page = page
        self.prompt = page.get_by_label("Message")
        self.send_button = page.get_by_role("button", name="Send")
        self.stop_button = page.get_by_role("button", name="Stop")
        self.status = page.get_by_role("status")
        self.model = page.get_by_label("Model")

    def settings(
        self,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        api_key: str | None = None,
    ) -> None:
        details = self.page.locator("details#settings")
        if details.get_attribute("open") is None:
            details.locator("summary").click()
        for label, value in (
            ("Max tokens", max_tokens),
            ("Temperature", temperature),
            ("API key", api_key),
        ):
            if value is not None:
                field = self.page.get_by_label(label, exact=True)
                field.fill(str(value))
                field.press("Tab")  # commits the value (the page saves on change)

    def wait_for_model(self, name: str = "smollm2") -> None:
        expect(self.model).to_have_value(name)

    def send(self, text: str) -> None:
        """Type a message and send it with Enter, as a keyboard user would."""
        self.prompt.fill(text)
        self.prompt.press("Enter")

    def answers(self) -> Locator:
        return self.page.locator("article.turn.assistant")

    def last_answer(self) -> Locator:
        return self.answers().last

    def record_answer_texts(self) -> None:
        """From now on, log every text the newest answer shows (read back with
        `recorded_answer_texts`)."""
        self.page.evaluate(
            """() => {
                window.answerTexts = [];
                const log = document.getElementById("conversation");
                new MutationObserver(() => {
                    const answers = log.querySelectorAll("article.turn.assistant .content");
                    const newest = answers[answers.length - 1];
                    if (newest) window.answerTexts.push(newest.textContent);
                }).observe(log, { childList: true, subtree: true, characterData: true });
            }"""
        )

    def recorded_answer_texts(self) -> list[str]:
        return self.page.evaluate("() => window.answerTexts")


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when the labelled series does not exist yet)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
