"""The web page shows a waiting call with Approve / Deny, in a real browser.

A real `keel up` (a child process) whose loadout makes `counter` need an
approval; the session's call waits; the page (Debian Chromium) shows the
call, its arguments and the two buttons, and says the session waits for
approval. Approve (with a note) commits the decision: the page settles the
card, and the tool's result arrives in the transcript, the counter applied
once. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, expect

from kernel import KernelClient
from services.common.config import Settings
from tests.support.approvals import counter_store, require_approval, until_waiting
from tests.support.internal_auth import with_token
from tests.support.web_page import (
    KEY,
    WAIT_MS,
    keel_up_process,
    launched_browser,
    require_chromium,
    screenshot_path,
)

pytestmark = [pytest.mark.slow, pytest.mark.browser]


async def test_the_approve_button_runs_the_waiting_call(tmp_path: Path) -> None:
    require_chromium()
    data_dir = tmp_path / "data"
    with keel_up_process(data_dir) as up:
        async with KernelClient(up.kernel_target, with_token(Settings())) as kernel:
            await require_approval(kernel)
        async with (
            httpx.AsyncClient(
                base_url=up.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
            ) as http,
            launched_browser() as browser,
        ):
            session_id = (await http.post("/v1/sessions", json={})).json()["id"]
            posted = await http.post(
                f"/v1/sessions/{session_id}/inputs",
                json={"text": '/tool counter {"key": "web-k"}', "requestId": "web-1"},
            )
            assert posted.status_code == 202, posted.text
            [pending] = (await until_waiting(http, session_id))["pendingApprovals"]
            await approve_in_the_page(browser, up.base_url, session_id)

            facts = (await http.get(f"/v1/sessions/{session_id}/events?format=json")).json()
            [decision] = [f for f in facts["facts"] if f["kind"] == "approval"]
            assert decision["data"]["toolCallId"] == pending["toolCallId"]
            assert decision["data"]["approve"] is True
            assert decision["data"]["note"] == "looks right"
            results = [f for f in facts["facts"] if f["kind"] == "tool_result"]
            assert len(results) == 1 and not results[0]["data"]["isError"]
    assert counter_store(data_dir).value("web-k") == 1


async def approve_in_the_page(browser: Browser, base_url: str, session_id: str) -> None:
    page = await browser.new_page(viewport={"width": 1100, "height": 760})
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    await page.goto(f"{base_url}/#key={KEY}&session={session_id}")

    card = page.locator('#transcript [data-kind="approval_requested"]')
    await expect(card).to_have_count(1, timeout=WAIT_MS)
    await expect(card).to_have_class("bubble approval pending")
    await expect(card.locator(".tool-name")).to_have_text("counter wants to run")
    await expect(card.locator("pre")).to_contain_text('"key": "web-k"')
    await expect(page.locator("#status")).to_have_attribute(
        "data-state", "awaiting_approval", timeout=WAIT_MS
    )
    await expect(page.locator("#status")).to_have_text("waiting for approval")
    await page.screenshot(path=str(screenshot_path("approval-waiting.png")))

    await card.locator(".approval-note").fill("looks right")
    await card.locator("button.approve").click()

    decided = page.locator('#transcript [data-kind="approval"]')
    await expect(decided).to_have_count(1, timeout=WAIT_MS)
    await expect(decided).to_contain_text("Approved counter")
    await expect(decided).to_contain_text("looks right")
    await expect(card.locator("button")).to_have_count(0)
    await expect(card).to_have_attribute("data-outcome", "approved")
    await expect(card.locator(".approval-state")).to_have_text("approved")
    result = page.locator('#transcript [data-kind="tool_result"]')
    await expect(result).to_have_count(1, timeout=WAIT_MS)
    await expect(result).to_contain_text('"value": 1')
    await expect(page.locator('#transcript [data-kind="assistant"]')).to_have_count(
        2, timeout=WAIT_MS
    )
    await expect(page.locator("#status")).to_have_attribute("data-state", "idle", timeout=WAIT_MS)
    await page.screenshot(path=str(screenshot_path("approval-approved.png")))
    assert page_errors == []
