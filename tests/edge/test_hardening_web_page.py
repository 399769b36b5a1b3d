"""The web page keeps its key out of URLs, under the edge's own CSP.

Attack reproduced: the page opened its SSE stream as
`…/events?access_token=<key>`, so the key sat in URLs (server logs, proxy
logs, the browser's history). The page now reads the stream with fetch()
and an Authorization header. It runs in headless Chromium against a real
`keel up`, under the edge's Content-Security-Policy header: its modules and
styles load, nothing is refused, and a broken stream (the edge process
killed; `keel up --processes` starts it again) is resumed from the page's
cursor.
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, ConsoleMessage, Request, expect

from tests.support.polling import eventually
from tests.support.web_page import (
    KEY,
    WAIT_MS,
    KeelUp,
    keel_up_process,
    require_chromium,
)

pytestmark = [pytest.mark.slow, pytest.mark.browser]
_EDGE_PID = re.compile(r"^\s*edge: pid (\d+)")


def edge_pid(up: KeelUp) -> int:
    pids = [int(m.group(1)) for line in up.child.lines if (m := _EDGE_PID.match(line))]
    assert pids, "keel up printed no edge pid"
    return pids[-1]


async def post_until_served(base_url: str, session_id: str, text: str) -> None:
    """Commits an input once the (restarted) edge answers."""
    body = {"text": text, "requestId": uuid.uuid4().hex}
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10
    ) as http:

        async def taken() -> bool:
            try:
                sent = await http.post(f"/v1/sessions/{session_id}/inputs", json=body)
            except httpx.TransportError:
                return False  # the edge is still restarting
            return sent.status_code in (200, 202)

        await eventually(taken, "the restarted edge to take the input", WAIT_MS / 1000)


async def test_the_page_streams_with_its_key_in_a_header_only(
    tmp_path: Path, browser: Browser
) -> None:
    require_chromium()
    with keel_up_process(tmp_path / "data", processes=True) as up:
        await page_checks(up, browser)


async def page_checks(up: KeelUp, browser: Browser) -> None:
    base_url = up.base_url
    context = await browser.new_context()
    page = await context.new_page()
    urls: list[str] = []
    streams: list[Request] = []
    console_errors: list[str] = []
    page_errors: list[str] = []

    def note_request(request: Request) -> None:
        urls.append(request.url)
        if request.url.split("?")[0].endswith("/events") and "format=json" not in request.url:
            streams.append(request)

    def note_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            console_errors.append(message.text)

    page.on("request", note_request)
    page.on("console", note_console)
    page.on("pageerror", lambda error: page_errors.append(str(error)))

    await page.goto(f"{base_url}/#key={KEY}")
    await page.click("#new-session")
    await expect(page.locator('#transcript [data-kind="session_created"]')).to_have_count(1)
    await expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    session_id = await page.locator("#sessions li[aria-selected='true']").get_attribute(
        "data-session-id"
    )
    assert session_id

    textarea = page.locator("#composer textarea")
    await textarea.fill("/slow 1 streamed with a header")
    await textarea.press("Enter")
    answer = page.locator('#transcript [data-kind="assistant"]')
    await expect(answer).to_contain_text("streamed with a header", timeout=WAIT_MS)

    # The stream breaks (its edge is killed) and is resumed from the page's
    # cursor once the edge is back: an input committed then shows up once.
    os.kill(edge_pid(up), signal.SIGKILL)
    await expect(page.locator("#connection")).to_have_attribute(
        "data-state", "connecting", timeout=WAIT_MS
    )
    await post_until_served(base_url, session_id, "sent after the break")
    resumed = page.locator('#transcript [data-kind="input"]', has_text="sent after the break")
    await expect(resumed).to_have_count(1, timeout=WAIT_MS)
    await expect(page.locator("#connection")).to_have_attribute(
        "data-state", "open", timeout=WAIT_MS
    )

    assert len(streams) >= 2, [r.url for r in streams]
    for stream in streams:
        headers = await stream.all_headers()
        assert headers.get("authorization") == f"Bearer {KEY}"
    assert not [url for url in urls if KEY in url or "access_token" in url]
    # Nothing refused by the Content-Security-Policy, no script error.
    assert not [e for e in console_errors if "Content Security Policy" in e], console_errors
    assert page_errors == []
    await context.close()
