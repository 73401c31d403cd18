"""The web page of ``epd serve`` in headless Chromium: upload an image, ask, read the answer and the
media table (encode, then chat with the same bytes served from the node cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.epd.conftest import ServeProcess, unique_png

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def test_upload_and_ask_in_the_browser(epd_server: ServeProcess, tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (scripts/setup_env.sh installs it)")
    from playwright.sync_api import sync_playwright

    picture = tmp_path / "picture.png"
    picture.write_bytes(unique_png(90, 70))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(epd_server.url + "/")
            assert page.locator("#answer").get_attribute("data-state") == "idle"
            page.set_input_files("#file", str(picture))
            page.fill("#max_tokens", "4")
            page.click("#submit")
            page.wait_for_selector("#answer[data-state=done], #answer[data-state=error]", timeout=90_000)
            answer = page.locator("#answer")
            assert answer.get_attribute("data-state") == "done", answer.text_content()
            rows = dict(
                (tr.locator("td").nth(0).text_content(), tr.locator("td").nth(1).text_content())
                for tr in page.locator("#media tbody tr").all()
            )
        finally:
            browser.close()
    assert rows["modality"] == "image"
    assert len(rows["key"] or "") == 64
    # A fresh picture: the encode misses, the chat that follows sends the same bytes and hits.
    assert rows["cache hit"] == "no"
    assert rows["chat cache hit"] == "yes"
    assert int(rows["completion tokens"] or 0) >= 1
    assert int(rows["prompt tokens"] or 0) > int(rows["tokens"] or 0) > 0
    assert answer is not None
