"""The session inspector and the page's previews, in a real browser.

A runner process is SIGKILLed mid-answer under `keel up --processes`; the
supervisor starts a new one, which takes the session over. The inspector must
show both epochs with the takeover marked (and the runtime change), and "what
the model saw" for the answer must hold the user's message. A screenshot is
kept under test-artifacts/ for a person to judge.

The previews (token partials) and the timeline model are also driven
directly in the page with deltas and facts of the documented shapes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page, expect

from tests.support.polling import eventually
from tests.support.web_page import (
    KEY,
    WAIT_MS,
    keel_up_process,
    require_chromium,
    screenshot_path,
)

pytestmark = [pytest.mark.slow, pytest.mark.browser]


SLOW = "/slow 3 one two three four five six seven eight"


async def facts_of(http: httpx.AsyncClient, session_id: str) -> list[dict[str, Any]]:
    page = (await http.get(f"/v1/sessions/{session_id}/events?format=json&limit=1000")).json()
    facts: list[dict[str, Any]] = page["facts"]
    return facts


async def test_the_inspector_shows_a_takeover_and_what_the_model_saw(
    tmp_path: Path,
    browser: Browser,
) -> None:
    require_chromium()
    with keel_up_process(tmp_path / "data", processes=True) as up:
        line = up.child.wait_for_line(lambda text: text.strip().startswith("runner-1: pid"), 5)
        runner_pid = int(line.split()[-1])
        async with httpx.AsyncClient(
            base_url=up.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ) as http:
            session_id = (await http.post("/v1/sessions", json={})).json()["id"]
            posted = await http.post(
                f"/v1/sessions/{session_id}/inputs", json={"text": SLOW, "requestId": "t-1"}
            )
            assert posted.status_code == 202, posted.text
            seq = posted.json()["seq"]

            async def started() -> bool | None:
                kinds = [f["kind"] for f in await facts_of(http, session_id)]
                return True if "epoch_started" in kinds else None

            await eventually(started, "the runner to start answering")
            os.kill(runner_pid, signal.SIGKILL)
            await up.child.line(lambda text: "runner-1" in text and "restarting" in text, 60)

            async def answered() -> list[dict[str, Any]] | None:
                facts = await facts_of(http, session_id)
                done = any(
                    f["kind"] == "assistant" and seq in f["data"].get("inputSeqs", [])
                    for f in facts
                )
                return facts if done else None

            facts = await eventually(answered, "the new runner to finish the answer", 60)

        epochs = [f["data"] for f in facts if f["kind"] == "epoch_started"]
        assert len(epochs) >= 2
        answer = next(f for f in facts if f["kind"] == "assistant")

        page = await browser.new_page(viewport={"width": 1400, "height": 820})
        page_errors: list[str] = []
        page.on("pageerror", lambda error: page_errors.append(str(error)))
        await page.goto(f"{up.base_url}/#key={KEY}&session={session_id}&view=inspector")
        inspector = page.locator("#inspector")
        await expect(inspector).to_be_visible()
        bands = inspector.locator(".epoch-band[data-transition]")
        await expect(bands).to_have_count(len(epochs), timeout=WAIT_MS)
        await expect(bands.first).to_have_attribute("data-transition", "first")
        takeover = inspector.locator('.epoch-band[data-transition="takeover"]')
        await expect(takeover).to_have_count(1)
        await expect(takeover).to_have_attribute("data-epoch", str(epochs[1]["epoch"]))
        mark = takeover.locator(".takeover-mark")
        await expect(mark).to_contain_text("Takeover")
        await expect(mark).to_contain_text(f"input #{seq}")
        old, new = epochs[0]["runtimeId"], epochs[1]["runtimeId"]
        change = f"runtime {old} → {new}" if old != new else f"same runtime {new}"
        await expect(mark.locator(".runtime-change")).to_have_text(change)
        await expect(mark).to_be_visible()
        await expect(inspector.locator(".inspector-summary")).to_contain_text("takeovers 1")
        # Every fact is on the timeline, by seq, in order.
        rows = inspector.locator(".tl-row")
        await expect(rows).to_have_count(len(facts))
        shown = await rows.evaluate_all("els => els.map(el => Number(el.dataset.seq))")
        assert shown == [f["seq"] for f in facts]

        # What the model saw for the answer: the request built at gen-N.
        at = int(answer["data"]["generationId"].removeprefix("gen-"))
        # (A click needs the button visible: the band must not hide its rows.)
        await inspector.locator(f'.tl-row[data-seq="{answer["seq"]}"] .saw').click()
        panel = inspector.locator(".context-panel")
        await expect(panel.locator(".ctx-system")).to_have_count(1, timeout=WAIT_MS)
        await expect(panel).to_contain_text(f"What the model saw for answer #{answer['seq']}")
        await expect(panel.locator(".chips")).to_contain_text(f"context at #{at}")
        await expect(panel.locator(".ctx-user")).to_have_count(1)
        await expect(panel.locator(".ctx-user .text")).to_have_text(SLOW)
        await page.screenshot(path=str(screenshot_path("inspector-takeover.png")))

        # The chat still shows the one answer, its preview gone.
        await page.click("#views button[data-view='chat']")
        await expect(page.locator('#transcript [data-kind="assistant"]')).to_have_count(1)
        await expect(page.locator(".pending-assistant")).to_have_count(0)
        assert page_errors == []


# ------------------------------------------------- modules, in the page


async def open_page(browser: Browser, base_url: str) -> Page:
    page = await browser.new_page()
    await page.goto(f"{base_url}/#key={KEY}")
    await expect(page.locator("#sessions")).to_be_attached()
    return page


PREVIEWS_SCRIPT = """async () => {
    const { Previews } = await import("./static/previews.js");
    const box = document.createElement("div");
    const previews = new Previews(box);
    const d = (epoch, attemptId, channel, text, extra = {}) =>
        previews.delta({ generationId: "gen-3", epoch, attemptId, channel, text, ...extra });
    const snap = () => ({
        bubbles: box.querySelectorAll(".pending-assistant").length,
        text: [...box.querySelectorAll(".pending-assistant > .text")].map((el) => el.textContent),
        calls: [...box.querySelectorAll(".tool-call")].map((el) => [
            el.dataset.toolCallId, el.querySelector(".tool-name").textContent,
            el.querySelector("pre").textContent]),
    });
    const steps = {};
    d(1, "a-1", "text", "Hello ");
    d(1, "a-1", "text", "wor");
    steps.first = snap();
    // The attempt failed; its retry streams the same generation again.
    d(1, "a-2", "text", "Hello");
    steps.retried = snap();
    // A successor epoch starts over; a late token of epoch 1 is ignored.
    d(2, "a-3", "text", "Hi");
    d(1, "a-2", "text", " stale");
    d(2, "a-3", "tool_call", '{"ke', { toolCallId: "c1", toolName: "counter" });
    d(2, "a-3", "tool_call", '{"seconds"', { toolCallId: "c2", toolName: "sleep" });
    d(2, "a-3", "tool_call", 'y":1}', { toolCallId: "c1" });
    steps.successor = snap();
    previews.commit("gen-3");
    d(2, "a-3", "text", " late");
    steps.committed = snap();
    return steps;
}"""


async def test_previews_are_keyed_by_generation_epoch_and_attempt(
    base_url: str,
    browser: Browser,
) -> None:
    page = await open_page(browser, base_url)
    steps = await page.evaluate(PREVIEWS_SCRIPT)
    assert steps["first"] == {"bubbles": 1, "text": ["Hello wor"], "calls": []}
    assert steps["retried"] == {"bubbles": 1, "text": ["Hello"], "calls": []}
    assert steps["successor"] == {
        "bubbles": 1,
        "text": ["Hi"],
        "calls": [
            ["c1", "Tool call: counter", '{"key":1}'],
            ["c2", "Tool call: sleep", '{"seconds"'],
        ],
    }
    assert steps["committed"] == {"bubbles": 0, "text": [], "calls": []}


def fact(seq: int, kind: str, **data: Any) -> dict[str, Any]:
    return {"seq": seq, "kind": kind, "timestamp": 0, "data": data}


def epoch(seq: int, number: int, runtime: str, watermark: int) -> dict[str, Any]:
    return fact(
        seq,
        "epoch_started",
        epoch=number,
        runtimeId=runtime,
        attemptId=f"a{seq}",
        watermark=watermark,
    )


# Epoch 1 answers #2; epoch 2 dies with #5 unanswered (takeover by epoch 3),
# which fails (retry by epoch 4); epoch 4 answers with a tool call left
# open, and epoch 5 takes that over; a compaction summarizes #2..#3.
TIMELINE_FACTS = [
    fact(1, "session_created"),
    fact(2, "input", text="hi"),
    epoch(3, 1, "rt-a", 2),
    fact(4, "assistant", generationId="gen-2", inputSeqs=[2], content=[]),
    fact(5, "input", text="again"),
    epoch(6, 2, "rt-a", 5),
    epoch(7, 3, "rt-b", 5),
    fact(8, "attempt_failed", error="boom", retryable=True, attempt=1),
    epoch(9, 4, "rt-b", 5),
    fact(10, "compaction", summarized=[2, 4], firstKept=5, summary="s"),
    fact(
        11,
        "assistant",
        generationId="gen-10",
        inputSeqs=[5],
        content=[],
        toolCalls=[{"id": "c1", "name": "clock", "arguments": {}}],
    ),
    epoch(12, 5, "rt-c", 5),
]


async def test_the_timeline_tells_takeovers_from_retries_and_new_work(
    base_url: str,
    browser: Browser,
) -> None:
    page = await open_page(browser, base_url)
    model = await page.evaluate(
        """async (facts) => {
            const { buildTimeline, describeOwed } = await import("./static/timeline.js");
            const model = buildTimeline(facts);
            return {
                bands: model.bands.map((b) => [b.epoch, b.transition, b.previousRuntimeId,
                    b.runtimeId, describeOwed(b.owed), b.facts.map((f) => f.seq)]),
                summarized: [...model.summarizedBy.entries()],
                kept: [...model.firstKeptBy.entries()],
            };
        }""",
        TIMELINE_FACTS,
    )
    assert model["bands"] == [
        [None, None, "", "", "", [1, 2]],
        [1, "first", "", "rt-a", "", [3, 4, 5]],
        [2, "next", "rt-a", "rt-a", "", [6]],
        [3, "takeover", "rt-a", "rt-b", "input #5", [7, 8]],
        [4, "retry", "rt-b", "rt-b", "input #5", [9, 10, 11]],
        [5, "takeover", "rt-b", "rt-c", "tool call clock", [12]],
    ]
    # The epoch fact #3 inside the range is bookkeeping, not summarized context.
    assert model["summarized"] == [[2, 10], [4, 10]]
    assert model["kept"] == [[5, 10]]
