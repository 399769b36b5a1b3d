"""The web chat page in a real browser (Debian Chromium) against a real `keel up`.

The page is reloaded while an answer is still streaming. After the answer
commits, the transcript must hold exactly one user input and exactly one
assistant answer: the streamed partial is replaced by the committed fact, and
a reload replays facts from the ledger without doubling anything.

Chromium comes from the system (`apt-get install chromium`), not from
Playwright's download. On a developer machine without it the test is skipped;
with CI=true it fails, because CI must never pass by skipping.

While a compaction runs the page must say so: the tenant's loadout is set to
compact quickly, and `/slowsummary` in the conversation makes the scripted
summary slow enough to watch. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, Request, expect

from tests.support.web_page import (
    KEY,
    WAIT_MS,
    keel_up_process,
    require_chromium,
    screenshot_path,
    talk_until_compacted,
    use_quick_compaction,
)

pytestmark = [pytest.mark.slow, pytest.mark.browser]

# Streamed over ~6 s: time to see tokens arrive, reload, and see more arrive.
WORDS = "the quick brown fox jumps over the lazy dog while the page reloads midway through"
MESSAGE = f"/slow 6 {WORDS}"
ANSWER = f"You said: {WORDS}"


async def transcript_counts(page: Page) -> dict[str, int]:
    """How many facts of each kind are on screen, and how often the answer
    text appears anywhere in the transcript (a doubled partial would show)."""
    counts: dict[str, int] = await page.evaluate(
        """(answer) => {
            const counts = {};
            for (const el of document.querySelectorAll("#transcript [data-kind]")) {
                counts[el.dataset.kind] = (counts[el.dataset.kind] || 0) + 1;
            }
            const text = document.querySelector("#transcript").innerText;
            counts.answerText = text.split(answer).length - 1;
            counts.pending = document.querySelectorAll(".pending-assistant").length;
            return counts;
        }""",
        ANSWER,
    )
    return counts


async def assert_one_exchange(page: Page) -> None:
    inputs = page.locator('#transcript [data-kind="input"]')
    answers = page.locator('#transcript [data-kind="assistant"]')
    await expect(answers).to_have_count(1, timeout=WAIT_MS)
    await expect(inputs).to_have_count(1)
    await expect(page.locator(".pending-assistant")).to_have_count(0, timeout=WAIT_MS)
    await expect(inputs.locator(".text")).to_have_text(MESSAGE)
    await expect(answers.locator(".text")).to_have_text(ANSWER)
    counts = await transcript_counts(page)
    assert counts["answerText"] == 1, counts
    assert counts["input"] == 1 and counts["assistant"] == 1, counts
    seqs = await page.locator("#transcript [data-seq]").evaluate_all(
        "els => els.map(el => Number(el.dataset.seq))"
    )
    assert seqs == sorted(set(seqs)), f"facts out of order or repeated: {seqs}"
    assert seqs[0] == 1, seqs


async def test_reload_mid_stream_shows_one_answer(base_url: str, browser: Browser) -> None:
    page = await browser.new_page(viewport={"width": 1100, "height": 720})
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    # Everything must come from the edge itself: no CDN, no web fonts.
    foreign: list[str] = []

    def note_request(request: Request) -> None:
        if not request.url.startswith((base_url, "data:")):
            foreign.append(request.url)

    page.on("request", note_request)

    await page.goto(f"{base_url}/#key={KEY}")
    # The key moved to localStorage and left the address bar.
    await expect(page.locator("#sessions")).to_be_attached()
    assert KEY not in page.url
    assert await page.evaluate("localStorage.getItem('keel.apiKey')") == KEY

    await page.click("#new-session")
    await expect(page.locator("#sessions li[aria-selected='true']")).to_have_count(1)
    await expect(page.locator('#transcript [data-kind="session_created"]')).to_have_count(1)
    session_id = await page.locator("#sessions li[aria-selected='true']").get_attribute(
        "data-session-id"
    )
    assert session_id and session_id in page.url

    textarea = page.locator("#composer textarea")
    await textarea.fill(MESSAGE)
    await textarea.press("Enter")
    await expect(page.locator('#transcript [data-kind="input"]')).to_have_count(1)
    await expect(textarea).to_have_value("")

    # Tokens stream into a pending bubble before anything is committed.
    pending = page.locator(".pending-assistant")
    await expect(pending).to_contain_text("You said: the quick", timeout=WAIT_MS)
    await expect(page.locator("#status")).to_have_attribute("data-state", "running")
    await expect(page.locator("#cancel")).to_be_visible()
    assert await page.locator('#transcript [data-kind="assistant"]').count() == 0

    # Reload mid-stream: the page replays the facts and attaches to the live
    # stream again, so later tokens keep arriving in a new pending bubble.
    await page.reload()
    await expect(page.locator("#sessions li[aria-selected='true']")).to_have_attribute(
        "data-session-id", session_id
    )
    await expect(page.locator('#transcript [data-kind="input"]')).to_have_count(1)
    await expect(pending).to_have_count(1, timeout=WAIT_MS)
    assert await page.locator('#transcript [data-kind="assistant"]').count() == 0, (
        "the answer committed before the reload finished: the stream is too short"
    )

    # The committed answer replaces the partial: one input, one answer.
    await assert_one_exchange(page)
    await expect(page.locator("#status")).to_have_attribute("data-state", "idle", timeout=WAIT_MS)
    await expect(page.locator("#cancel")).to_be_hidden()

    # A reload after the fact shows the same transcript, nothing doubled.
    await page.reload()
    await assert_one_exchange(page)

    await page.screenshot(path=str(screenshot_path("chat-after-reload.png")))
    assert page_errors == []
    assert foreign == []


async def test_the_page_says_compacting_while_a_compaction_runs(
    tmp_path: Path, browser: Browser
) -> None:
    require_chromium()
    with keel_up_process(tmp_path / "data") as up:
        await use_quick_compaction(up.kernel_target)
        async with httpx.AsyncClient(
            base_url=up.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ) as http:
            session_id = (await http.post("/v1/sessions", json={})).json()["id"]
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            page_errors: list[str] = []
            page.on("pageerror", lambda error: page_errors.append(str(error)))
            await page.goto(f"{up.base_url}/#key={KEY}&session={session_id}")
            await expect(page.locator('#transcript [data-kind="session_created"]')).to_have_count(1)

            # The first message ends up in the first summary, which then
            # streams for 3 s: long enough for the page to show it.
            texts = ["/slowsummary 3 remember the lighthouse", *["/long 300"] * 16]
            talking = asyncio.create_task(talk_until_compacted(http, session_id, texts))
            compacting = page.locator('#status[data-state="compacting"]')
            shown = asyncio.create_task(
                expect(compacting).to_contain_text("compacting", timeout=90_000)
            )
            try:
                # A conversation that fails before the compaction must say why.
                await asyncio.wait({talking, shown}, return_when=asyncio.FIRST_COMPLETED)
                if talking.done() and talking.exception() is not None:
                    raise talking.exception()  # type: ignore[misc]
                await shown
                await page.screenshot(path=str(screenshot_path("chat-compacting.png")))
                facts = await talking
            finally:
                for task in (talking, shown):
                    task.cancel()
                await asyncio.gather(talking, shown, return_exceptions=True)

            # The compaction is a maintenance fact in the chat, and the
            # inspector marks what it summarized and where it kept from.
            compaction = next(f for f in facts if f["kind"] == "compaction")
            first, last = compaction["data"]["summarized"]
            await expect(page.locator('#transcript [data-kind="compaction"]')).to_have_count(
                1, timeout=WAIT_MS
            )
            await page.click("#views button[data-view='inspector']")
            inspector = page.locator("#inspector")
            await expect(inspector.locator('.tl-row[data-kind="compaction"]')).to_contain_text(
                f"summarized #{first}\u2013#{last}"  # an en dash, as on the page
            )
            summarized = inspector.locator(".tl-row.summarized")
            assert await summarized.count() >= 1
            seqs = await summarized.evaluate_all("els => els.map(el => Number(el.dataset.seq))")
            assert min(seqs) == first and max(seqs) <= last, seqs
            kinds = await summarized.evaluate_all("els => els.map(el => el.dataset.kind)")
            assert set(kinds) <= {"input", "assistant", "tool_result"}, kinds
            kept = inspector.locator(f'.tl-row[data-seq="{compaction["data"]["firstKept"]}"]')
            await expect(kept).to_contain_text(f"first kept by #{compaction['seq']}")
            await kept.scroll_into_view_if_needed()
            await expect(kept).to_be_visible()
            # The answer after the compaction was built from its summary.
            after = next(
                f for f in facts if f["kind"] == "assistant" and f["seq"] > compaction["seq"]
            )
            await inspector.locator(f'.tl-row[data-seq="{after["seq"]}"] .saw').click()
            panel = inspector.locator(".context-panel")
            await expect(panel.locator(".chips")).to_contain_text(
                f"compaction #{compaction['seq']}", timeout=WAIT_MS
            )
            await expect(panel.locator(".ctx-summary")).to_have_count(1)
            await expect(panel.locator(".ctx-summary")).to_contain_text(
                "compacted into the following summary"
            )
            await page.screenshot(path=str(screenshot_path("inspector-compaction.png")))
            assert page_errors == []
