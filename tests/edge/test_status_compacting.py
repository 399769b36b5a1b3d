"""`GET /v1/sessions/{id}` says `compacting` while the owner runner writes a
summary, and `idle` once the session has settled.

The loadout gives the scripted model a small context window, so a few long
answers make a compaction due; the first input contains `/slowsummary 3`,
which makes the summary of any history holding it stream for ~3 s."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.runner.server import RunnerServer
from tests.support.edge_stack import DEADLINE_S, Stack

pytestmark = pytest.mark.slow

POLL_S = 0.05


async def test_a_session_is_reported_compacting_while_its_summary_is_written(
    stack: Stack, runner: RunnerServer
) -> None:
    await stack.cluster.kernel.put_loadout(
        "default",
        {
            "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": 2400},
            "compaction": {"enabled": True, "keepRecentTokens": 700, "reserveTokens": 600},
        },
    )
    session = await stack.new_session()
    seen: list[str] = []

    async def settled() -> bool:
        response = await stack.http.get(f"/v1/sessions/{session}")
        assert response.status_code == 200, response.text
        view = response.json()
        seen.append(view["status"])
        return view["status"] == "idle" and not view["owedInputs"]

    async def compactions() -> int:
        return sum(1 for f in await stack.facts(session) if f.kind == "compaction")

    texts = ["/slowsummary 3 keep this in mind", *["/long 300"] * 16]
    deadline = time.monotonic() + 4 * DEADLINE_S
    for n, text in enumerate(texts):
        posted = await stack.post_input(session, text, f"turn-{n}")
        assert posted.status_code == 202, posted.text
        # Watch this turn until it settles; a compaction runs inside a turn.
        while not await settled():
            assert time.monotonic() < deadline, f"turn {n} did not settle; saw {set(seen)}"
            await asyncio.sleep(POLL_S)
        if await compactions():
            break
    assert await compactions() >= 1, "the history never made a compaction due"
    assert "compacting" in seen, f"never reported compacting; saw {set(seen)}"
    assert seen[-1] == "idle"
