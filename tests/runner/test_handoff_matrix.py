"""A handoff drain at every commit boundary, with an SSE client attached.

The first runner process drains itself exactly at the point named by
KEEL_FAULT_POINT (KEEL_FAULT_ACTION=drain: it prints `FAULT <point>` and
starts a handoff drain right there); a second runner process takes the
session over. A point that is a boundary stops the attempt there; a point
inside a step (the watermark, a model stream, a tool run, a summary) lets
the step commit and stops at the boundary after it. Each case says which
facts the drained epoch committed and which the successor's epoch did, so a
drain that stops a step early or late fails here.

A client follows the session's event stream through an edge from before the
first input, reconnecting with Last-Event-ID when a stream ends (to the
other edge when its edge drains too). It must see every fact once, in seq
order without a gap, exactly what the ledger holds: each input answered
once, one result per tool call, the successor's epoch_started with epoch+1
and no fact of the drained epoch after it. A handoff stops only after a
committed tool result, so no tool runs twice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from services.common.config import Settings
from services.ledger import CommittedFact
from services.runner.tool_state import counter_store
from tests.support.handoff_matrix import (
    HandoffStack,
    SseFollower,
    answered_in,
    following,
    handoff_stack,
    runtime_id_of,
)
from tests.support.ledger_invariants import (
    assert_handed_over,
    assert_recovered,
    assert_stream_continuous,
)
from tests.support.polling import eventually
from tests.support.processes import ChildProcess

TWO_COUNTERS = '/tool counter {"key": "KEY-a"} | counter {"key": "KEY-b"}'
ONE_COUNTER = '/tool counter {"key": "KEY-a"}'
# `counter` waits for a person's approval in the "approval" script.
APPROVAL_LOADOUT = {
    "tools": [{"source": "builtin", "names": ["clock", "counter"], "requireApproval": ["counter"]}]
}
LONG_TURN = "/long 300"
# The loadout of the compaction cases makes a compaction due within a few
# LONG_TURNs; this many without one is a failure.
MAX_TURNS = 12
# What an epoch committed, in short: an answer with tool calls (`call`), a
# tool result, a final answer, a compaction.
CALL, RESULT, ANSWER, COMPACTION = "call", "result", "answer", "compaction"
ASKED = "approval_requested"


@dataclass(frozen=True)
class Case:
    fault: str  # KEEL_FAULT_POINT of the first runner
    # "tools" (TWO_COUNTERS), "hello", "compaction" (LONG_TURNs), or
    # "approval" (ONE_COUNTER, which waits for a person's decision)
    script: str
    drained: tuple[str, ...]  # what the drained epoch committed
    successor: tuple[str, ...]  # what the successor's epoch committed
    # An input sent once the first runner drains: where the drained epoch
    # left nothing owed, it is the successor's work.
    late_input: bool = False
    # The client's edge drains at the same moment (both roll at once).
    edge_drains: bool = False
    variant: str = ""

    @property
    def name(self) -> str:
        return self.fault.partition("@")[0] + (f"-{self.variant}" if self.variant else "")


CASES = [
    # Points inside a step (or just after the watermark): the step commits,
    # the boundary after it stops the attempt.
    Case("after_watermark", "tools", (CALL,), (RESULT, RESULT, ANSWER)),
    Case("mid_stream", "tools", (CALL,), (RESULT, RESULT, ANSWER)),
    Case("mid_stream@2", "tools", (CALL, RESULT, RESULT, ANSWER), (ANSWER,), True, variant="final"),
    Case("mid_tool", "tools", (CALL, RESULT), (RESULT, ANSWER)),
    Case("mid_summary", "compaction", (COMPACTION,), (ANSWER,)),
    Case("after_final_before_finish", "hello", (ANSWER,), (ANSWER,), True),
    # Commit boundaries: the attempt stops right there.
    Case("after_assistant_commit", "tools", (CALL,), (RESULT, RESULT, ANSWER)),
    Case("after_some_tool_results", "tools", (CALL, RESULT), (RESULT, ANSWER)),
    Case("after_tool_results", "tools", (CALL, RESULT, RESULT), (ANSWER,)),
    Case("after_final_answer", "hello", (ANSWER,), (ANSWER,), True),
    Case("after_compaction", "compaction", (COMPACTION,), (ANSWER,)),
    # Waiting for an approval: the drained runner holds nothing while the
    # call waits; the decision wakes the session on the successor.
    Case("after_approval_requested", "approval", (CALL, ASKED), (RESULT, ANSWER)),
    # The client's edge drains too: it reconnects to the other edge.
    Case("mid_tool", "tools", (CALL, RESULT), (RESULT, ANSWER), edge_drains=True, variant="edge"),
    Case("after_final_answer", "hello", (ANSWER,), (ANSWER,), True, True, variant="edge"),
]


@pytest.fixture
async def stack(pg_settings: Settings) -> AsyncIterator[HandoffStack]:
    async with handoff_stack(pg_settings) as running:
        yield running


def describe(facts: list[CommittedFact]) -> str:
    """The facts in short, for a failure's message."""
    return "; ".join(
        f"{f.seq} {f.kind}@{f.epoch}"
        + (f" by {f.data['runtimeId']}" if f.kind == "epoch_started" else "")
        for f in facts
    )


def shape(facts: list[CommittedFact], epoch: int, after: int = 0) -> tuple[str, ...]:
    """What one epoch committed after its epoch_started (and after seq
    `after`: a sticky epoch spans several turns), in short."""
    kinds = []
    for fact in facts:
        if fact.epoch != epoch or fact.kind == "epoch_started" or fact.seq <= after:
            continue
        if fact.kind == "assistant":
            kinds.append(CALL if fact.data.get("toolCalls") else ANSWER)
        elif fact.kind == "tool_result":
            kinds.append(RESULT)
        else:
            kinds.append(fact.kind)
    return tuple(kinds)


async def compact_until_fault(
    stack: HandoffStack, follower: SseFollower, session: str, first: ChildProcess, point: str
) -> list[int]:
    """Sends one long turn at a time until the first runner reaches `point`
    in the compaction the turns make due; returns the inputs' seqs."""
    await stack.cluster.kernel.put_loadout(
        "default",
        {
            "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": 2400},
            "compaction": {"enabled": True, "keepRecentTokens": 700, "reserveTokens": 600},
        },
    )
    seqs: list[int] = []
    for index in range(MAX_TURNS):
        seq = await stack.post_input(session, LONG_TURN, f"turn-{index}")
        seqs.append(seq)

        async def fault_or_answer(seq: int = seq) -> str | None:
            if f"FAULT {point}" in first.lines:
                return "fault"
            return "answered" if answered_in(follower.facts, seq) else None

        if await eventually(fault_or_answer, f"turn {index} or FAULT {point}") == "fault":
            return seqs
    raise AssertionError(f"no compaction reached FAULT {point} in {MAX_TURNS} turns")


async def decide_waiting_call(stack: HandoffStack, session: str) -> None:
    """Approves the call the session waits on, once the successor is up."""
    facts = await stack.facts(session)
    [asked] = [f for f in facts if f.kind == ASKED]
    response = await stack.http.post(
        f"/v1/sessions/{session}/approvals",
        json={"toolCallId": asked.data["toolCallId"], "approve": True},
    )
    assert response.status_code == 201, response.text


# Runners that keep sessions between turns (the default) and runners that
# do not: a handoff must be seamless either way.
STICKY = {"sticky": "30000", "cold": "0"}


@pytest.mark.slow
@pytest.mark.parametrize("sticky", list(STICKY))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_a_handoff_at_this_point_is_seamless_for_the_client(
    stack: HandoffStack, case: Case, sticky: str
) -> None:
    session = f"handoff-{case.name.replace('_', '-')}"
    point = case.fault.partition("@")[0]
    cluster = stack.cluster
    first = cluster.start_runner(
        KEEL_FAULT_POINT=case.fault, KEEL_FAULT_ACTION="drain", KEEL_STICKY_MS=STICKY[sticky]
    )
    await cluster.runner_ready(first)
    first_id = runtime_id_of(first)
    await stack.new_session(session)

    async with following(stack.edges, session) as follower:
        if case.script == "compaction":
            seqs = await compact_until_fault(stack, follower, session, first, point)
        else:
            if case.script == "approval":
                await stack.cluster.kernel.put_loadout("default", APPROVAL_LOADOUT)
            text = {"tools": TWO_COUNTERS, "approval": ONE_COUNTER}.get(case.script, "hello")
            seqs = [await stack.post_input(session, text.replace("KEY", session), "first")]
            await first.line(lambda line: line == f"FAULT {point}", deadline_s=60)
        if case.edge_drains:
            gateway = stack.edges[0].gateway
            assert gateway is not None
            gateway.start_draining("handoff")

        second = cluster.start_runner(KEEL_STICKY_MS=STICKY[sticky])
        await cluster.runner_ready(second)
        second_id = runtime_id_of(second)
        if case.script == "approval":
            await decide_waiting_call(stack, session)
        if case.late_input:
            # Only once the kernel hands the drained runner nothing more, so
            # the late input is the successor's whatever the timing.
            await stack.drain_visible(first_id)
            seqs.append(await stack.post_input(session, "after the handoff", "late"))

        for seq in seqs:
            await follower.answered(seq)
        await cluster.settled(stack.ledger_id(session))
        facts = await stack.facts(session)
        head = facts[-1].seq
        await follower.until(lambda seen: bool(seen) and seen[-1].seq >= head, f"seq {head}")

    assert_stream_continuous(follower.seqs)
    sent = [(f.seq, f.kind, f.epoch, f.data) for f in follower.facts]
    assert sent == [(f.seq, f.kind, f.epoch, f.data) for f in facts], "the client saw other facts"
    assert_recovered(facts)
    consumed = sorted(
        s for f in facts if f.kind == "assistant" for s in f.data.get("inputSeqs") or ()
    )
    assert consumed == seqs, "every input answered once"

    # One attempt per input the first runner was given (the compaction
    # script sends them one at a time; a sticky runner answers them all
    # under its first epoch): a drained runner claims nothing more.
    claimed = len(seqs) if case.script == "compaction" and sticky == "cold" else 1
    started = [
        f.seq for f in facts if f.kind == "epoch_started" and f.data["runtimeId"] == first_id
    ]
    assert len(started) == claimed, f"{first_id} claimed again while draining: {describe(facts)}"
    old_epoch = assert_handed_over(facts, first_id, second_id)
    # The turn the drain met: a sticky runner answered the earlier ones
    # under the same epoch.
    turn = seqs[-1] if case.script == "compaction" and sticky == "sticky" else 0
    committed = (shape(facts, old_epoch, turn), shape(facts, old_epoch + 1))
    assert committed == (case.drained, case.successor), (
        f"drained at {point}, {first_id} then {second_id}: {describe(facts)}"
    )
    assert follower.drains == (1 if case.edge_drains else 0)
    # Nor a preview of the drained epoch once the successor has started.
    successor_start = follower.timeline.index(("epoch_started", old_epoch + 1))
    late = follower.timeline[successor_start:]
    assert ("delta", old_epoch) not in late, f"a delta of epoch {old_epoch} after its successor"

    if case.script in ("tools", "approval"):
        counters = counter_store(cluster.settings)
        keys = ("a", "b") if case.script == "tools" else ("a",)
        for key in (f"{session}-{k}" for k in keys):
            assert (counters.value(key), counters.executions(key)) == (1, 1), key
    # A drained runner may exit once its drain completes; it must not fail.
    assert first.proc.poll() in (None, 0), first.output()
    assert not any(line.startswith("FAULT") for line in second.lines)
