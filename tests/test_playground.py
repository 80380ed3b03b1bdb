"""The chat playground at `/` in headless Chromium (Debian's `chromium`, driven by Playwright): type a question,
see the answer stream in token by token over the SSE API, with TTFT, tokens/s and the server's metrics,
through an API key. The answer is the engine's own greedy reply to the same messages."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import running_server, tiny_engine
from test_server import make_settings

from inferlab.server import create_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "k-page"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None and not os.environ.get("CI"),
        reason="no chromium here (CI installs it: `make browser`, Debian's chromium package)",
    ),
]

# every change of the answer's text, with its length, recorded in the page as it happens
WATCH = """() => {
  window.textLengths = [];
  new MutationObserver(() => {
    const answer = document.querySelector('.msg.assistant span');
    if (answer) window.textLengths.push(answer.textContent.length);
  }).observe(document.getElementById('chat'), {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture
def page():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' installs playwright")
    assert CHROMIUM, "CI must install chromium (make browser)"
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1100, "height": 720})
        finally:
            browser.close()


def test_a_question_streams_its_answer_with_ttft_and_rate(tiny_tokenizer, page, tmp_path):
    engine = tiny_engine(tiny_tokenizer, max_new_tokens=24)
    question = "What is a KV cache?"
    reference = engine.chat([{"role": "user", "content": question}], max_new_tokens=24)
    with running_server(create_app(engine, make_settings(api_keys=[KEY]), "tiny")) as url:
        page.goto(url + "/")
        page.wait_for_selector("#model:has-text('API key')")  # without the key the server says so
        page.fill("#api_key", KEY)
        page.dispatch_event("#api_key", "change")
        page.wait_for_selector("#model:text-is('tiny')")
        page.fill("#max_tokens", "24")
        page.evaluate(WATCH)
        page.fill("#prompt", question)
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant .stats:has-text('tokens/s')", timeout=30_000)

        answer = page.locator(".msg.assistant")
        assert answer.locator("span").first.text_content() == reference.text
        assert page.locator(".msg.user").text_content() == question
        lengths = page.evaluate("window.textLengths")
        assert len(set(lengths)) > 3 and lengths == sorted(lengths)  # it grew piece by piece, not at once
        assert (
            float(answer.get_attribute("data-ttft-ms")) > 0 and float(answer.get_attribute("data-tokens-per-sec")) > 0
        )
        page.wait_for_selector("#metrics dt:text-is('completed') + dd:not(:text-is('0'))", timeout=10_000)
        page.screenshot(path=str(tmp_path / "playground.png"))
