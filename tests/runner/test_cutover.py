"""Cutover discipline: after a handoff, the old runtime's writer is fenced off.

A writer that does not pass the fence must not exist. The old runtime drains
(handoff), the new one claims with epoch+1; any write the old runtime could
still attempt with its epoch — an answer, a tool result, a compaction, even a
new epoch_started with a stale epoch — is rejected and changes nothing.
"""

from __future__ import annotations

import pytest

from services.ledger import StaleEpoch
from services.runner.client import RunnerClient
from tests.support.cluster import Cluster
from tests.support.ledger_invariants import assert_recovered
from tests.support.polling import eventually

pytestmark = pytest.mark.slow


async def test_the_old_writer_is_rejected_after_cutover(cluster: Cluster) -> None:
    old = cluster.start_runner()
    address = await cluster.runner_ready(old)
    await cluster.new_session("cutover")
    await cluster.send("cutover", '/tool sleep {"seconds": 1} | clock {}', "r1")

    async def old_epoch() -> int | None:
        facts = await cluster.facts("cutover")
        starts = [f.data["epoch"] for f in facts if f.kind == "epoch_started"]
        return starts[0] if starts else None

    stale = await eventually(old_epoch, "the old runtime to claim")
    async with RunnerClient(address, cluster.settings) as runner:
        await runner.drain("handoff", deadline_ms=30_000)

    new = cluster.start_runner()
    await cluster.runner_ready(new)
    await cluster.settled("cutover")
    before = await cluster.facts("cutover")
    assert max(f.data["epoch"] for f in before if f.kind == "epoch_started") == stale + 1

    attempts = [
        ("assistant", {"generationId": "gen-stale", "content": [], "toolCalls": []}),
        ("attempt_failed", {"error": "late", "retryable": True, "attempt": 1}),
        ("compaction", {"summary": "stale", "firstKept": 2}),
        ("epoch_started", {"epoch": stale, "runtimeId": "old", "attemptId": "a", "watermark": 0}),
    ]
    for kind, data in attempts:
        with pytest.raises(StaleEpoch):
            await cluster.ledger.append_one("cutover", kind, data, epoch=stale)
    after = await cluster.facts("cutover")
    assert after == before
    assert_recovered(after)
