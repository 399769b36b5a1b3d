"""SIGKILL a real runner at every named commit point; a successor finishes.

The runner under test freezes at the point named by KEEL_FAULT_POINT and
prints `FAULT <point>`; the test then kills it with a real SIGKILL (and
checks that a SIGKILL, not some other exit, ended it). A fresh runner takes
over (the kernel expires the dead runner's lease as soon as its Attach
stream breaks) and the ledger must show: every input answered exactly once,
by an answer within its epoch's watermark, exactly one result per tool call
and after its call, seqs contiguous, no fact of the dead epoch after the
successor's epoch_started, and effects applied once. Every row runs on
PostgreSQL and on SQLite.

How a row brings the doomed runner to its point (`Row.script`):
- "queued": its inputs wait for it, all sent before it starts;
- "compaction": long turns, one at a time, under a loadout with a small
  context window, until one of them makes a compaction due;
- "cancel": its input is cancelled, as the edge does it, once the runner
  works on it (runs a long tool call, or streams a long answer);
- "woken": its inputs one at a time, each once the one before is answered:
  the runner keeps the session (KEEL_STICKY_MS=30000) and runs
  the later turns as wakes under its first epoch, so the kill lands in a
  woken turn. The successor still takes over with the next epoch.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from services.common.config import Settings
from services.ledger import CommittedFact
from services.runner.tool_state import counter_store
from tests.support.cluster import Cluster, running_cluster
from tests.support.ledger_invariants import assert_recovered
from tests.support.polling import eventually
from tests.support.processes import ChildProcess

TWO_COUNTERS = '/tool counter {"key": "KEY-a"} | counter {"key": "KEY-b"}'
# Long enough that only a cancel ends them.
LONG_TOOL = '/tool sleep {"seconds": 600}'
LONG_ANSWER = "/slow 600 an answer only a cancel ends"
LONG_TURN = "/long 300"
# The compaction row's loadout makes a compaction due within a few
# LONG_TURNs; this many without one is a failure (no FAULT line comes).
MAX_TURNS = 12
COMPACTING_LOADOUT = {
    "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": 2400},
    "compaction": {"enabled": True, "keepRecentTokens": 700, "reserveTokens": 600},
}
DEADLINE_S = 60.0


@dataclass(frozen=True)
class Row:
    case: str
    fault: str  # KEEL_FAULT_POINT of the doomed runner
    # The scripted model acts on the latest input, so tool effects come from it.
    inputs: tuple[str, ...] = ()
    script: str = "queued"  # "queued", "compaction" or "cancel"

    @property
    def point(self) -> str:
        return self.fault.partition("@")[0]


ROWS = [
    Row("after_claim-1", "after_claim", ("hello",)),
    Row("after_claim-2", "after_claim", ("first", TWO_COUNTERS)),
    Row("after_watermark-1", "after_watermark", ("hello",)),
    Row("after_watermark-2", "after_watermark", ("first", "second")),
    Row("mid_stream-1", "mid_stream", ("/slow 1 stream this answer slowly",)),
    Row("mid_stream-2", "mid_stream@2", (TWO_COUNTERS,)),
    Row("after_assistant_commit-1", "after_assistant_commit", (TWO_COUNTERS,)),
    Row("after_assistant_commit-2", "after_assistant_commit", ("hello", TWO_COUNTERS)),
    Row("mid_tool-1", "mid_tool", (TWO_COUNTERS,)),
    Row("mid_tool-2", "mid_tool@2", (TWO_COUNTERS,)),
    Row("after_some_tool_results-1", "after_some_tool_results", (TWO_COUNTERS,)),
    Row("after_some_tool_results-2", "after_some_tool_results", ("hello", TWO_COUNTERS)),
    Row("after_tool_results-1", "after_tool_results", (TWO_COUNTERS,)),
    Row("after_tool_results-2", "after_tool_results", ("hello", TWO_COUNTERS)),
    Row("after_compaction-1", "after_compaction", script="compaction"),
    Row("mid_cancel-tool", "mid_cancel", (LONG_TOOL,), script="cancel"),
    Row("mid_cancel-answer", "mid_cancel", (LONG_ANSWER,), script="cancel"),
    Row("after_final_before_finish-1", "after_final_before_finish", ("hello",)),
    Row("after_final_before_finish-2", "after_final_before_finish", ("hello", TWO_COUNTERS)),
    Row("woken-after_watermark", "after_watermark@2", ("hello", "second"), script="woken"),
    Row("woken-mid_tool", "mid_tool", ("hello", TWO_COUNTERS), script="woken"),
    Row(
        "woken-after_assistant_commit",
        "after_assistant_commit",
        ("hello", TWO_COUNTERS),
        script="woken",
    ),
    Row(
        "woken-after_final_before_finish",
        "after_final_before_finish@2",
        ("hello", "second"),
        script="woken",
    ),
]


@pytest.fixture
async def cluster(settings: Settings) -> AsyncIterator[Cluster]:
    """A cluster on each backend (`settings` is SQLite, then PostgreSQL)."""
    async with running_cluster(settings, backoff_base_ms=100, max_attempts=3) as running:
        yield running


def answered(facts: list[CommittedFact], seq: int) -> bool:
    return any(seq in (f.data.get("inputSeqs") or ()) for f in facts if f.kind == "assistant")


async def turn_by_turn(
    cluster: Cluster, session: str, doomed: ChildProcess, point: str, texts: list[str]
) -> list[int]:
    """Sends the inputs one at a time, each once the one before is answered,
    until the doomed runner reaches `point` (or all are sent); returns the
    inputs' seqs."""
    seqs: list[int] = []
    for index, text in enumerate(texts):
        seq = await cluster.send(session, text, f"r{index}")
        seqs.append(seq)

        async def fault_or_answer(seq: int = seq) -> str | None:
            if f"FAULT {point}" in doomed.lines:
                return "fault"
            return "answered" if answered(await cluster.facts(session), seq) else None

        if await eventually(fault_or_answer, f"input {index} or FAULT {point}") == "fault":
            return seqs
    # A point after the final answer (after_final_before_finish) comes once
    # the last input is answered: the caller waits for it.
    return seqs


async def cancel_once_working(cluster: Cluster, session: str, *, on_call: bool) -> None:
    """Cancels as the edge does (a `cancelled` fact, then a wake-up), once the
    runner is inside the work: its tool call committed (`on_call`), or its
    epoch started (the answer streams)."""

    async def working() -> bool | None:
        facts = await cluster.facts(session)
        if on_call:
            inside = any(f.kind == "assistant" and f.data["toolCalls"] for f in facts)
        else:
            inside = any(f.kind == "epoch_started" for f in facts)
        return True if inside else None

    await eventually(working, f"the runner to work on {session}", DEADLINE_S)
    await cluster.ledger.append_one(session, "cancelled", {"reason": "client"})
    await cluster.kernel.enqueue(session, "default")


def assert_epochs(row: Row, facts: list[CommittedFact]) -> None:
    """What each epoch wrote, given where the doomed one died."""
    starts = [f for f in facts if f.kind == "epoch_started"]
    if row.point == "after_claim":
        # Killed holding a claim with nothing committed: no fact of its
        # epoch exists, and the successor's claim is the next epoch.
        assert [f.data["epoch"] for f in starts] == [2], "the successor's epoch follows the claim"
    elif row.point == "after_final_before_finish":
        # Everything was answered before the kill: the successor's claim
        # (which `settled` waited for: the lease is released, nothing queued)
        # finds nothing owed and writes nothing, not even an epoch.
        assert len(starts) == 1, "nothing was owed, so the successor adds no fact"
    else:
        assert len(starts) >= 2, "the successor must have taken over with a new epoch"
    last = starts[-1].data["epoch"]
    if row.point == "after_compaction":
        [compaction] = [f for f in facts if f.kind == "compaction"]
        assert compaction.epoch < last, "the dead epoch compacted; the successor did not again"
        [final] = [f for f in facts if f.kind == "assistant" and f.epoch == last]
        assert final.seq > compaction.seq and final.data.get("inputSeqs")
    if row.point == "mid_cancel":
        settlement = facts[-1]
        assert (settlement.kind, settlement.epoch) == ("assistant", last), "the successor settles"
        assert settlement.data["stopReason"] == "cancelled"
        closed = [f for f in facts if f.kind == "tool_result"]
        assert all(f.epoch < last and f.data["content"] == "cancelled" for f in closed), (
            "the dead epoch closed the open call; the successor did not close it again"
        )
        assert len(closed) == (1 if row.inputs[-1] == LONG_TOOL else 0)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=[r.case for r in ROWS])
async def test_successor_finishes_after_sigkill(cluster: Cluster, row: Row) -> None:
    session = f"crash-{row.case.replace('_', '-')}"
    await cluster.new_session(session)
    texts = [text.replace("KEY", session) for text in row.inputs]
    seqs = []
    if row.script != "woken":
        seqs = [await cluster.send(session, text, f"r{i}") for i, text in enumerate(texts)]
    if row.script == "compaction":
        await cluster.kernel.put_loadout("default", COMPACTING_LOADOUT)

    # The woken rows need a runner that keeps sessions between turns.
    sticky = {"KEEL_STICKY_MS": "30000"} if row.script == "woken" else {}
    doomed = cluster.start_runner(KEEL_FAULT_POINT=row.fault, **sticky)
    if row.script == "woken":
        seqs = await turn_by_turn(cluster, session, doomed, row.point, texts)
        starts = [f for f in await cluster.facts(session) if f.kind == "epoch_started"]
        assert [f.data["epoch"] for f in starts] == [1], "the later turn was a wake of epoch 1"
    elif row.script == "compaction":
        # Long turns one at a time until one makes a compaction due.
        seqs += await turn_by_turn(cluster, session, doomed, row.point, [LONG_TURN] * MAX_TURNS)
    elif row.script == "cancel":
        await cancel_once_working(cluster, session, on_call=row.inputs[-1] == LONG_TOOL)
    await doomed.line(lambda line: line == f"FAULT {row.point}", deadline_s=DEADLINE_S)
    doomed.kill()
    assert doomed.proc.returncode == -signal.SIGKILL, (
        f"the runner ended by {doomed.proc.returncode}, not by SIGKILL:\n{doomed.output()}"
    )

    successor = cluster.start_runner()
    await cluster.runner_ready(successor)
    await cluster.settled(session, deadline_s=DEADLINE_S)

    facts = await cluster.facts(session)
    assert_recovered(facts)
    assert_epochs(row, facts)
    consumed = sorted(
        s for f in facts if f.kind == "assistant" for s in f.data.get("inputSeqs") or ()
    )
    assert consumed == seqs
    if row.inputs and row.inputs[-1] == TWO_COUNTERS:
        counter = counter_store(cluster.settings)
        for key in (f"{session}-a", f"{session}-b"):
            assert counter.value(key) == 1, f"the effect of {key} was applied twice"
            assert counter.executions(key) >= 1
        if row.point == "mid_tool":
            # The killed attempt ran the tool; the successor ran it again.
            first = f"{session}-b" if row.fault.endswith("@2") else f"{session}-a"
            assert counter.executions(first) == 2
    assert not any(line.startswith("FAULT") for line in successor.lines)
