"""A stale owner that really races: its write arrives after its successor's.

A runner stops itself (SIGSTOP, `KEEL_FAULT_ACTION=stop`) at `mid_tool`: the
tool has run, its result is not committed. Its lease runs out (its Attach
stream stays open, so only the TTL ends it), a successor takes the session
with epoch+1, runs the call again under the same idempotency key and answers.
Then the stopped runner is resumed. It goes on exactly where it stopped, so
its very next act is the commit of the result, with the old epoch: the
ledger must refuse it (`STALE_EPOCH`), and the test fails unless that
refused write is seen (the runner logs the fence). Nothing of the old epoch
lands after the successor's `epoch_started`, and the effect is applied once.

Rounds differ in which call of a tool round the owner stops at. More rounds
run in `keel chaos` and scripts/acceptance-all.sh.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

import pytest

from agent_io.tools import CounterStore
from services.common.config import Settings
from tests.processes import ChildProcess
from tests.runner.cluster import Cluster, eventually, start_cluster, stop_cluster
from tests.runner.invariants import assert_handed_over, assert_recovered
from tests.support.tool_fixtures import alive, parent_of

pytestmark = pytest.mark.slow

LEASE_MS = 1500
TWO_COUNTERS = '/tool counter {"key": "KEY-a"} | counter {"key": "KEY-b"}'
# (round, fault point, the call whose result the stale owner tries to commit)
ROUNDS = [("first-call", "mid_tool@1", "KEY-a"), ("second-call", "mid_tool@2", "KEY-b")]


@pytest.fixture
async def cluster(pg_settings: Settings) -> AsyncIterator[Cluster]:
    running = await start_cluster(pg_settings.with_overrides(lease_ms=LEASE_MS))
    try:
        yield running
    finally:
        await stop_cluster(running)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize(("name", "fault", "late_key"), ROUNDS, ids=[r[0] for r in ROUNDS])
async def test_a_resumed_stale_owner_writes_and_is_refused(
    cluster: Cluster, name: str, fault: str, late_key: str
) -> None:
    session = f"stale-{name}"
    await cluster.new_session(session)
    seq = await cluster.send(session, TWO_COUNTERS.replace("KEY", session), "r1")

    stale = cluster.start_runner(KEEL_FAULT_POINT=fault, KEEL_FAULT_ACTION="stop")
    stale_id = await runtime_id(stale)
    await stale.line(lambda line: line == "FAULT mid_tool", deadline_s=60)
    try:
        await eventually(
            lambda: _true(stopped(stale.pid)), "the owner to stop itself", deadline_s=30
        )
        successor = cluster.start_runner()
        successor_id = await runtime_id(successor)
        await cluster.settled(session, deadline_s=60)
    finally:
        os.kill(stale.pid, signal.SIGCONT)

    # The resumed owner's next act is the stale commit; the ledger refuses it.
    await stale.line(lambda line: "fenced off by a newer epoch" in line, deadline_s=30)
    assert alive(stale.pid) and parent_of(stale.pid) is not None, "it was refused, not killed"

    facts = await cluster.facts(session)
    assert_recovered(facts)
    old_epoch = assert_handed_over(facts, stale_id, successor_id)
    late = session + late_key.removeprefix("KEY")
    results = [f for f in facts if f.kind == "tool_result"]
    assert all(f.epoch in (old_epoch, old_epoch + 1) for f in results)
    consumed = [s for f in facts if f.kind == "assistant" for s in f.data.get("inputSeqs") or ()]
    assert consumed == [seq], "answered once"
    counter = CounterStore(cluster.settings.data_dir / "counter.sqlite3")
    # The stale owner ran the call it stopped in; the successor ran it again.
    assert counter.value(late) == 1 and counter.executions(late) == 2


async def _true(value: bool) -> bool | None:
    return True if value else None


async def runtime_id(runner: ChildProcess) -> str:
    """The runner's id, from the line it prints once it serves."""
    line = await runner.line(lambda text: text.startswith("runner ") and " listening on " in text)
    return line.split()[1]
