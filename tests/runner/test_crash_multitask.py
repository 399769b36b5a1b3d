"""SIGKILL a real runner in the middle of an interrupt and of a rollback.

The session's first input is a slow answer; once the runner works on it, a
second input comes as the edge sends it for that strategy (`interrupt`: the
input marked; `rollback`: a cancel naming the input, then the input, in one
append). The doomed runner freezes at a named point (KEEL_FAULT_POINT) and
is SIGKILLed there:
- `mid_stream`: still streaming the first answer, before it could act on
  the second input;
- `before_final_answer`: it acted on it (stopped the first answer, or
  withdrew the first input) and is about to commit the next answer.
A successor finishes, and the ledger must show every input settled exactly
once: after an interrupt one answer covers both inputs; after a rollback the
first input is withdrawn (settled as cancelled) and never answered, and only
the second is answered. Both backends.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from services.common.config import Settings
from services.ledger import CommittedFact, FactToAppend
from services.ledger.facts import ASSISTANT, CANCELLED, INPUT
from services.session_invariants import check_session
from tests.support.cluster import Cluster, running_cluster
from tests.support.ledger_invariants import assert_recovered
from tests.support.polling import eventually

SLOW = "/slow 6 the answer under way"
SECOND = "the second message"
DEADLINE_S = 60.0

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Row:
    strategy: str  # interrupt or rollback
    fault: str


ROWS = [
    Row("interrupt", "mid_stream"),
    Row("interrupt", "before_final_answer"),
    Row("rollback", "mid_stream"),
    Row("rollback", "before_final_answer"),
]


@pytest.fixture
async def cluster(settings: Settings) -> AsyncIterator[Cluster]:
    async with running_cluster(settings, backoff_base_ms=100, max_attempts=3) as running:
        yield running


async def _second(cluster: Cluster, session: str, strategy: str) -> int:
    """The second input, committed as the edge commits it, then the wake-up."""
    data = {"text": SECOND, "requestId": "r-second", "multitask": strategy}
    facts = [FactToAppend(INPUT, data)]
    if strategy == "rollback":
        withdraw = {"reason": "rollback", "requestId": "r-second"}
        facts.insert(0, FactToAppend(CANCELLED, withdraw))
    seq = (await cluster.ledger.append(session, facts))[-1].seq
    await cluster.kernel.enqueue(session, "default", input_seq=seq)
    return seq


def _as_json(facts: list[CommittedFact]) -> list[dict[str, object]]:
    return [{"seq": f.seq, "kind": f.kind, "epoch": f.epoch, "data": dict(f.data)} for f in facts]


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.strategy}-{r.fault}" for r in ROWS])
async def test_a_successor_settles_every_input_once(cluster: Cluster, row: Row) -> None:
    session = f"multitask-{row.strategy}-{row.fault.replace('_', '-')}"
    await cluster.new_session(session)
    first = await cluster.send(session, SLOW, "r-first")
    doomed = cluster.start_runner(KEEL_FAULT_POINT=row.fault)

    async def working() -> bool:
        return any(f.kind == "epoch_started" for f in await cluster.facts(session))

    await eventually(working, "the runner to work on the first input", DEADLINE_S)
    second = await _second(cluster, session, row.strategy)
    await doomed.line(lambda line: line == f"FAULT {row.fault}", deadline_s=DEADLINE_S)
    doomed.kill()
    assert doomed.proc.returncode == -signal.SIGKILL, doomed.output()

    successor = cluster.start_runner()
    await cluster.runner_ready(successor)
    await cluster.settled(session, deadline_s=DEADLINE_S)

    facts = await cluster.facts(session)
    assert_recovered(facts)
    assert check_session(session, _as_json(facts)) == []
    settled = [
        (f.data.get("stopReason"), f.data["inputSeqs"])
        for f in facts
        if f.kind == ASSISTANT and f.data.get("inputSeqs")
    ]
    if row.strategy == "interrupt":
        # One answer for both: the first was never answered alone.
        assert [seqs for _, seqs in settled] == [[first, second]], settled
        if row.fault == "before_final_answer":
            # The doomed runner died after acting on the interrupt.
            assert "interrupted by a new input" in doomed.output(), doomed.output()
    else:
        # Withdrawn, never answered; the second answered alone.
        assert settled == [("cancelled", [first]), (settled[1][0], [second])], settled
        assert settled[1][0] != "cancelled"
        if row.fault == "before_final_answer":
            # The doomed runner withdrew the first input before it died.
            withdrawal = next(f for f in facts if f.data.get("stopReason") == "cancelled")
            assert withdrawal.epoch == 1, withdrawal
