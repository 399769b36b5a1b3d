"""The loadout comes with the claim: a runner process asks the kernel for
no loadout per attempt, and still runs each attempt on the latest revision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common import hops
from tests.support.cluster import Cluster
from tests.support.ledger_invariants import assert_recovered

GET_LOADOUT = "keel.kernel.v1.KernelService/GetLoadout"


@pytest.mark.parametrize("sticky_ms", ["30000", "0"], ids=["sticky", "cold"])
async def test_attempts_run_the_claimed_revision_without_asking_for_it(
    cluster: Cluster, tmp_path: Path, sticky_ms: str
) -> None:
    first = await cluster.kernel.put_loadout("default", {"systemPrompt": "First revision."})
    recorded = tmp_path / "requests.jsonl"
    runner = cluster.start_runner(KEEL_RECORD_REQUESTS=str(recorded), KEEL_STICKY_MS=sticky_ms)
    await cluster.runner_ready(runner)
    await cluster.new_session("steady")
    # The kernel serves in this process: its count of calls received.
    before = hops.snapshot()
    for turn in range(3):
        await cluster.send("steady", f"turn {turn}", f"r{turn}")
        await cluster.settled("steady")
    second = await cluster.kernel.put_loadout("default", {"systemPrompt": "Second revision."})
    await cluster.send("steady", "after the change", "r3")
    await cluster.settled("steady")
    calls = hops.snapshot().since(before).calls

    assert calls.get(GET_LOADOUT, 0) == 0, calls
    facts = await cluster.facts("steady")
    assert_recovered(facts)
    pinned = [f.data["loadoutRevision"] for f in facts if f.kind == "epoch_started"]
    # A sticky runner answers the first three turns under one epoch; the new
    # revision ends its window, so the next turn is claimed afresh.
    assert pinned == ([first, second] if sticky_ms != "0" else [first, first, first, second])
    systems = [json.loads(line)["system"] for line in recorded.read_text().splitlines()]
    assert systems == ["First revision."] * 3 + ["Second revision."]
