"""The runner's memory of the sessions it keeps (services/runner/sticky.py):
a hold outlives the window the kernel granted by a margin, so a wake the
kernel decided just before the window's end still finds the session kept
(its hub open for the edge watching it) when it arrives."""

from __future__ import annotations

import asyncio
import time

from kernel import Lease
from services.runner.sticky import StickyHolds


def _lease(session_id: str) -> Lease:
    return Lease(
        session_id=session_id,
        tenant_id="t",
        runtime_id="A",
        attempt_id="a1",
        epoch=1,
        expires_at_ms=0,
        reclaimed=False,
        failures=0,
    )


async def test_a_hold_outlives_a_window_that_just_ended_by_the_kernels_clock() -> None:
    over: list[str] = []
    holds = StickyHolds(over.append)
    ended_now_ms = int(time.time() * 1000)
    holds.keep(_lease("s1"), ended_now_ms)
    for _ in range(5):
        await asyncio.sleep(0)  # let any timer already due run
    assert "s1" in holds and over == []
    # The late wake finds it kept, and taking it ends the hold for good.
    taken = holds.take("s1")
    assert taken is not None and taken.epoch == 1
    assert "s1" not in holds and len(holds) == 0


async def test_a_hold_ends_by_itself_after_its_margin() -> None:
    ended = asyncio.Event()
    holds = StickyHolds(lambda session_id: ended.set())
    # Long past: its margin is over too.
    holds.keep(_lease("s1"), int(time.time() * 1000) - 60_000)
    await asyncio.wait_for(ended.wait(), 5)
    assert "s1" not in holds
