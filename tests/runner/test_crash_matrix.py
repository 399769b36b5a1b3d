"""SIGKILL a real runner at every named commit point; a successor finishes.

The runner under test freezes at the point named by KEEL_FAULT_POINT and
prints `FAULT <point>`; the test then kills it with a real SIGKILL. A fresh
runner takes over (the kernel expires the dead runner's lease as soon as its
Attach stream breaks) and the ledger must show: every input answered exactly
once, exactly one result per tool call, seqs contiguous, no fact of the dead
epoch after the successor's epoch_started, and effects applied once.
"""

from __future__ import annotations

import pytest

from agent_io.tools import CounterStore
from tests.runner.cluster import Cluster
from tests.runner.invariants import assert_recovered

TWO_COUNTERS = '/tool counter {"key": "KEY-a"} | counter {"key": "KEY-b"}'
# (case id, KEEL_FAULT_POINT, inputs queued before the doomed runner starts).
# The scripted model acts on the latest input, so tool effects come from it.
CASES = [
    ("after_watermark-1", "after_watermark", ["hello"]),
    ("after_watermark-2", "after_watermark", ["first", "second"]),
    ("mid_stream-1", "mid_stream", ["/slow 1 stream this answer slowly"]),
    ("mid_stream-2", "mid_stream@2", [TWO_COUNTERS]),
    ("after_assistant_commit-1", "after_assistant_commit", [TWO_COUNTERS]),
    ("after_assistant_commit-2", "after_assistant_commit", ["hello", TWO_COUNTERS]),
    ("mid_tool-1", "mid_tool", [TWO_COUNTERS]),
    ("mid_tool-2", "mid_tool@2", [TWO_COUNTERS]),
    ("after_some_tool_results-1", "after_some_tool_results", [TWO_COUNTERS]),
    ("after_some_tool_results-2", "after_some_tool_results", ["hello", TWO_COUNTERS]),
    ("after_final_before_finish-1", "after_final_before_finish", ["hello"]),
    ("after_final_before_finish-2", "after_final_before_finish", ["hello", TWO_COUNTERS]),
]


@pytest.mark.parametrize(("case", "fault", "inputs"), CASES, ids=[c[0] for c in CASES])
async def test_successor_finishes_after_sigkill(
    cluster: Cluster, case: str, fault: str, inputs: list[str]
) -> None:
    session = f"crash-{case.replace('_', '-')}"
    await cluster.new_session(session)
    texts = [text.replace("KEY", session) for text in inputs]
    seqs = [await cluster.send(session, text, f"r{i}") for i, text in enumerate(texts)]

    point = fault.partition("@")[0]
    doomed = cluster.start_runner(KEEL_FAULT_POINT=fault)
    await doomed.line(lambda line: line == f"FAULT {point}", deadline_s=60)
    doomed.kill()

    successor = cluster.start_runner()
    await cluster.runner_ready(successor)
    await cluster.settled(session, deadline_s=60)

    facts = await cluster.facts(session)
    assert_recovered(facts)
    starts = [f for f in facts if f.kind == "epoch_started"]
    if point == "after_final_before_finish":
        # Everything was answered before the kill: the successor's claim
        # (which `settled` waited for: the lease is released, nothing queued)
        # finds nothing owed and writes nothing, not even an epoch.
        assert len(starts) == 1, "nothing was owed, so the successor adds no fact"
    else:
        assert len(starts) >= 2, "the successor must have taken over with a new epoch"
    consumed = sorted(
        s for f in facts if f.kind == "assistant" for s in f.data.get("inputSeqs") or ()
    )
    assert consumed == seqs
    if inputs[-1] == TWO_COUNTERS:
        counter = CounterStore(cluster.settings.data_dir / "counter.sqlite3")
        for key in (f"{session}-a", f"{session}-b"):
            assert counter.value(key) == 1, f"the effect of {key} was applied twice"
            assert counter.executions(key) >= 1
        if point == "mid_tool":
            # The killed attempt ran the tool; the successor ran it again.
            first = f"{session}-b" if fault.endswith("@2") else f"{session}-a"
            assert counter.executions(first) == 2
