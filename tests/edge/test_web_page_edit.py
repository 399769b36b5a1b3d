"""Edit and resend from the web page, in a real browser (Debian Chromium)
against a real `keel up`: Edit on a message sends the edited text in a new
session forked just before it, which the page opens; the original session
keeps its message and answer."""

from __future__ import annotations

import pytest
from playwright.async_api import Browser, Dialog, expect

from tests.support.web_page import WAIT_MS, chat_on_a_new_session, screenshot_path

pytestmark = [pytest.mark.slow, pytest.mark.browser]


async def test_edit_forks_the_session_and_answers_the_edited_message(
    base_url: str, browser: Browser
) -> None:
    chat = await chat_on_a_new_session(browser, base_url)
    page, original = chat.page, chat.session_id
    selected = page.locator("#sessions li[aria-selected='true']")

    textarea = page.locator("#composer textarea")
    await textarea.fill("the first version")
    await textarea.press("Enter")
    answers = page.locator('#transcript [data-kind="assistant"]')
    await expect(answers).to_have_count(1, timeout=WAIT_MS)

    async def edit(dialog: Dialog) -> None:
        assert dialog.default_value == "the first version"
        await dialog.accept("the second version")

    page.once("dialog", edit)
    await page.locator('#transcript [data-kind="input"] button.edit').click()
    await expect(selected).not_to_have_attribute("data-session-id", original, timeout=WAIT_MS)
    await expect(page.locator('#transcript [data-kind="forked_from"]')).to_contain_text(
        f"Forked from {original} at #1"
    )
    await expect(page.locator('#transcript [data-kind="input"] .text')).to_have_text(
        "the second version"
    )
    await expect(answers.locator(".text")).to_have_text(
        "You said: the second version", timeout=WAIT_MS
    )
    await page.screenshot(path=str(screenshot_path("chat-edited.png")))

    # The original keeps its message and its answer.
    await page.locator(f"#sessions li[data-session-id='{original}']").click()
    await expect(page.locator('#transcript [data-kind="input"] .text')).to_have_text(
        "the first version"
    )
    await expect(answers.locator(".text")).to_have_text("You said: the first version")
    assert chat.errors == []
