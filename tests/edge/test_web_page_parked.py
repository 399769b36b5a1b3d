"""A parked session recovered from the web page, in a real browser (Debian
Chromium) against a real `keel up`.

`/fail` is an input the scripted model fails on for good, so the session
parks at once. The page must say why, offer Retry, Skip and Cancel, keep a
message sent meanwhile owed (not answered with the failed one), and after
Skip show the failed input as skipped and answer the later message alone.
"""

from __future__ import annotations

import httpx
import pytest
from playwright.async_api import Browser, expect

from tests.support.polling import eventually
from tests.support.web_page import KEY, WAIT_MS, chat_on_a_new_session, screenshot_path

pytestmark = [pytest.mark.slow, pytest.mark.browser]

LATER = "hello after the failure"


async def test_a_parked_session_is_skipped_from_the_page(base_url: str, browser: Browser) -> None:
    chat = await chat_on_a_new_session(browser, base_url)
    page, session_id = chat.page, chat.session_id

    textarea = page.locator("#composer textarea")
    await textarea.fill("/fail")
    await textarea.press("Enter")
    parked = page.locator('#transcript [data-kind="session_parked"]')
    await expect(parked).to_contain_text("Session parked on #2", timeout=WAIT_MS)
    await expect(page.locator("#status")).to_have_attribute("data-state", "parked")
    await expect(parked.locator("button.skip")).to_be_visible()
    await expect(parked.locator("button.retry-parked")).to_be_visible()
    await expect(page.locator("#cancel")).to_be_visible()

    await textarea.fill(LATER)
    await textarea.press("Enter")
    await expect(page.locator('#transcript [data-kind="input"]')).to_have_count(2)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}
    ) as http:
        session = (await http.get(f"/v1/sessions/{session_id}")).json()
        # Owed, and the session still parked on the failed input alone.
        assert session["status"] == "parked", session
        assert session["parkedOn"] == [2], session
        owed = session["owedInputs"]
        assert len(owed) == 2 and owed[0] == 2, session
        await page.screenshot(path=str(screenshot_path("chat-parked.png")))

        await parked.locator("button.skip").click()
        skipped = page.locator('#transcript [data-kind="inputs_skipped"]')
        await expect(skipped).to_contain_text("Skipped #2", timeout=WAIT_MS)
        answers = page.locator('#transcript [data-kind="assistant"]')
        await expect(answers).to_have_count(1, timeout=WAIT_MS)
        await expect(answers.locator(".text")).to_have_text(f"You said: {LATER}")
        await expect(parked.locator("button.skip")).to_have_count(0)
        await expect(page.locator("#transcript .fact-input.skipped")).to_have_count(1)

        async def answered_alone() -> list[int] | None:
            facts = (
                await http.get(f"/v1/sessions/{session_id}/events", params={"format": "json"})
            ).json()["facts"]
            for fact in facts:
                if fact["kind"] == "assistant":
                    seqs: list[int] = fact["data"]["inputSeqs"]
                    return seqs
            return None

        assert await eventually(answered_alone, "the later input's answer") == [owed[1]]
    await page.screenshot(path=str(screenshot_path("chat-parked-skipped.png")))
    assert chat.errors == []
