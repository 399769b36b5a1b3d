"""Sticky sessions with real runner processes: the next input of a kept
session goes to the runner that keeps it, under the same epoch; a holder
SIGKILLed while keeping one, or drained, loses it at once to another.

Windows here are far longer than any deadline of the test (10 minutes), so
a session that reaches another runner in time was let go by the event under
test, not by its window running out.
"""

from __future__ import annotations

import asyncio

import pytest

from kernel import EpochSuperseded, KernelClient, LeaseLost
from kernel.domain import LeaseState, SessionRecord
from kernel.store import LeaseStore
from services.ledger import CommittedFact, StaleEpoch
from services.runner.client import RunnerClient
from tests.support.cluster import Cluster
from tests.support.handoff_matrix import runtime_id_of
from tests.support.ledger_invariants import assert_recovered
from tests.support.polling import eventually

LONG_WINDOW = {"KEEL_STICKY_MS": "600000"}


def leases(cluster: Cluster) -> LeaseStore:
    store = cluster.kernel_server.leases
    assert store is not None
    return store


def kept_record(cluster: Cluster, session_id: str) -> SessionRecord | None:
    """The kernel's record of a session (its lease state)."""
    return leases(cluster).record(session_id)


def epochs_of(facts: list[CommittedFact], kind: str) -> list[int]:
    return [f.epoch for f in facts if f.kind == kind]


def runtimes_started(facts: list[CommittedFact]) -> list[str]:
    return [f.data["runtimeId"] for f in facts if f.kind == "epoch_started"]


async def test_a_kept_session_is_answered_by_the_same_runner_with_the_same_epoch(
    cluster: Cluster,
) -> None:
    runner = cluster.start_runner(**LONG_WINDOW)
    await cluster.runner_ready(runner)
    await cluster.new_session("kept")
    wakes_before = cluster.kernel_server.metrics.totals().get("wakes", 0)
    for turn in range(3):
        await cluster.send("kept", f"turn {turn}", f"r{turn}")
        await cluster.settled("kept")

    facts = await cluster.facts("kept")
    assert_recovered(facts)
    # One claim, one fence: the next two turns came as wakes.
    assert epochs_of(facts, "epoch_started") == [1]
    assert epochs_of(facts, "assistant") == [1, 1, 1]
    assert cluster.kernel_server.metrics.totals().get("wakes", 0) - wakes_before == 2
    answered = [f.data["inputSeqs"] for f in facts if f.kind == "assistant"]
    inputs = [[f.seq] for f in facts if f.kind == "input"]
    assert answered == inputs, "each input answered once, in order"
    # Between turns the session is kept, holding no slot of its tenant.
    record = kept_record(cluster, "kept")
    assert record is not None and record.state is LeaseState.STICKY
    assert leases(cluster).slots("default")[0] == 0


@pytest.mark.slow
async def test_a_holder_killed_while_keeping_a_session_is_taken_over_with_a_new_epoch(
    cluster: Cluster,
) -> None:
    first = cluster.start_runner(**LONG_WINDOW)
    await cluster.runner_ready(first)
    first_id = runtime_id_of(first)
    await cluster.new_session("orphan")
    await cluster.send("orphan", "before", "r1")
    await cluster.settled("orphan")
    record = kept_record(cluster, "orphan")
    assert record is not None and record.state is LeaseState.STICKY
    first.kill()  # a real SIGKILL, while it keeps the session

    second = cluster.start_runner(**LONG_WINDOW)
    await cluster.runner_ready(second)
    second_id = runtime_id_of(second)
    seq = await cluster.send("orphan", "after", "r2")
    await cluster.settled("orphan")

    facts = await cluster.facts("orphan")
    assert_recovered(facts)
    assert runtimes_started(facts) == [first_id, second_id]
    assert epochs_of(facts, "epoch_started") == [1, 2]
    inputs = [f.seq for f in facts if f.kind == "input"]
    finals = [f for f in facts if f.kind == "assistant" and f.data.get("inputSeqs")]
    assert inputs[-1] == seq
    # Nothing lost, nothing doubled: one answer each, the second by the successor.
    assert [(f.data["inputSeqs"], f.epoch) for f in finals] == [([inputs[0]], 1), ([seq], 2)]


@pytest.mark.slow
async def test_a_drain_lets_the_kept_sessions_go_at_once(cluster: Cluster) -> None:
    first = cluster.start_runner(**LONG_WINDOW)
    address = await cluster.runner_ready(first)
    await cluster.new_session("drained-1")
    await cluster.new_session("drained-2")
    for session in ("drained-1", "drained-2"):
        await cluster.send(session, "hello", "r1")
        await cluster.settled(session)
        record = kept_record(cluster, session)
        assert record is not None and record.state is LeaseState.STICKY

    async with RunnerClient(address, cluster.settings) as runner:
        outcome = await runner.drain_outcome("handoff", deadline_ms=30_000)
    assert outcome.finished and outcome.in_flight_runs == 0
    for session in ("drained-1", "drained-2"):
        record = kept_record(cluster, session)
        assert record is not None and record.state is LeaseState.RELEASED, record
    assert await asyncio.to_thread(first.proc.wait, 30) == 0

    second = cluster.start_runner(**LONG_WINDOW)
    await cluster.runner_ready(second)
    second_id = runtime_id_of(second)
    for session in ("drained-1", "drained-2"):
        await cluster.send(session, "after the drain", "r2")
        await cluster.settled(session)
        facts = await cluster.facts(session)
        assert_recovered(facts)
        assert runtimes_started(facts)[-1] == second_id
        assert epochs_of(facts, "epoch_started") == [1, 2]


async def test_a_runner_asking_for_no_window_is_claimed_every_turn(cluster: Cluster) -> None:
    runner = cluster.start_runner(KEEL_STICKY_MS="0")
    await cluster.runner_ready(runner)
    await cluster.new_session("cold")
    for turn in range(2):
        await cluster.send("cold", f"turn {turn}", f"r{turn}")
        await cluster.settled("cold")

    facts = await cluster.facts("cold")
    assert_recovered(facts)
    assert epochs_of(facts, "epoch_started") == [1, 2]

    async def freed() -> bool | None:
        record = kept_record(cluster, "cold")
        return True if record is not None and record.state is LeaseState.FINISHED else None

    await eventually(freed, "the session finished, not kept")


async def test_a_stale_keepers_writes_are_refused_after_a_takeover(cluster: Cluster) -> None:
    """A runner that kept epoch 1 and was passed over (its window ended: it
    drained) is fenced off by the ledger once the successor's epoch starts,
    and the kernel refuses its epoch too."""
    async with (
        KernelClient(cluster.kernel_server.target, cluster.settings) as keeper,
        KernelClient(cluster.kernel_server.target, cluster.settings) as successor,
    ):
        await keeper.register_runtime("keeper")
        await successor.register_runtime("successor")
        await cluster.new_session("fenced")
        await cluster.send("fenced", "first", "r1")
        claim = await keeper.claim_with_loadout("keeper")
        assert claim is not None
        epoch = claim.lease.epoch
        await cluster.ledger.append_one("fenced", "epoch_started", started(epoch, "keeper"), epoch)
        await cluster.ledger.append_one("fenced", "assistant", answer("gen-2", [2]), epoch)
        kept = await keeper.finish("fenced", epoch, "keeper", read_through=2, sticky_ms=600_000)
        assert kept.sticky_until_ms > 0

        await keeper.set_drain("keeper", "handoff")
        seq = await cluster.send("fenced", "second", "r2")
        lease = await successor.claim("successor")
        assert lease is not None and lease.epoch == epoch + 1
        await cluster.ledger.append_one(
            "fenced", "epoch_started", started(lease.epoch, "successor", seq), lease.epoch
        )

        with pytest.raises(StaleEpoch):
            await cluster.ledger.append_one("fenced", "assistant", answer("gen-5", [seq]), epoch)
        with pytest.raises((EpochSuperseded, LeaseLost)):
            await keeper.finish("fenced", epoch, "keeper", read_through=seq)
    facts = await cluster.facts("fenced")
    assert [f.epoch for f in facts if f.kind == "assistant"] == [epoch]


def started(epoch: int, runtime_id: str, watermark: int = 2) -> dict[str, object]:
    return {"epoch": epoch, "runtimeId": runtime_id, "attemptId": "a", "watermark": watermark}


def answer(generation: str, input_seqs: list[int]) -> dict[str, object]:
    return {"generationId": generation, "content": [], "inputSeqs": input_seqs}


async def test_inputs_sent_as_soon_as_each_answer_shows_stay_on_one_epoch(
    cluster: Cluster,
) -> None:
    """A client that sends its next input the moment it sees an answer races
    the runner's Finish: the input is either a wake or holds the lease on,
    never a claim of its own."""
    runner = cluster.start_runner(**LONG_WINDOW)
    await cluster.runner_ready(runner)
    await cluster.new_session("eager")
    stream = cluster.ledger.subscribe("eager", 0)
    for turn in range(6):
        seq = await cluster.send("eager", f"turn {turn}", f"r{turn}")
        async for fact in stream:
            if fact.kind == "assistant" and seq in (fact.data.get("inputSeqs") or ()):
                break
    await cluster.settled("eager")
    facts = await cluster.facts("eager")
    assert_recovered(facts)
    assert epochs_of(facts, "epoch_started") == [1]
    assert epochs_of(facts, "assistant") == [1] * 6
