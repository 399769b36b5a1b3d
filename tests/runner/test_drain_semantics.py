"""What a drain means, exactly (SPEC §3, as agreed for rolling handoffs).

- `shutdown`: the attempt is really stopped before the drain returns (no
  step of it goes on, nothing of it commits after), and its lease is
  released at once, not left to the TTL.
- A lost lease ends every task of the attempt, not only the outer one.
- `handoff`: one audit row per session actually handed off, naming the
  successor once it claims and the loadout revision the attempt pinned; a
  session whose answer was done on the old runner writes none.
- A drain that has not finished can be undone; a finished one cannot, and
  the drained runner process exits 0.
- KEEL_DRAIN_DEADLINE_MS is the SIGTERM handoff's deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kernel.domain import LeaseState
from kernel.handoffs import HandoffNote
from kernel.registry import STALE_AFTER_MS, Registration
from kernel.store import LeaseStore
from services.common.config import Settings
from services.ledger import CommittedFact
from services.runner.client import RunnerClient
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer, advertised_address, check_addresses
from tests.support.cluster import Cluster, wait_for_kind
from tests.support.kernel_stores import open_stores
from tests.support.ledger_invariants import assert_recovered
from tests.support.polling import eventually

TOOLS = '/tool counter {"key": "%s"} | counter {"key": "%s-2"}'


def in_process_runner(cluster: Cluster, settings: Settings | None = None) -> RunnerServer:
    return RunnerServer(
        settings or cluster.settings,
        RunnerConfig(cluster.ledger_server.target, cluster.kernel_server.target),
    )


def turn_tasks(session_id: str) -> list[asyncio.Task[object]]:
    """The attempt's inner turn tasks still alive in this loop."""
    return [
        t for t in asyncio.all_tasks() if t.get_name() == f"turns-{session_id}" and not t.done()
    ]


def leases(cluster: Cluster) -> LeaseStore:
    store = cluster.kernel_server.leases
    assert store is not None
    return store


async def lease_state(cluster: Cluster, session_id: str) -> LeaseState:
    record = await asyncio.to_thread(leases(cluster).record, session_id)
    assert record is not None
    state: LeaseState = record.state
    return state


def finals(facts: list[CommittedFact]) -> list[CommittedFact]:
    return [f for f in facts if f.kind == "assistant" and f.data.get("inputSeqs")]


@pytest.mark.slow
async def test_a_shutdown_drain_stops_the_attempt_and_releases_its_lease_at_once(
    cluster: Cluster,
) -> None:
    old = await in_process_runner(cluster).start()
    try:
        await cluster.new_session("stop")
        seq = await cluster.send("stop", "/slow 4 an answer that takes a while", "r1")
        await wait_for_kind(cluster, "stop", "epoch_started")
        assert old.runtime is not None
        result = await old.runtime.drain("shutdown", 30_000)
        assert (result.in_flight, result.stopped, result.finished) == (1, 1, True)
        # Stopped before the drain returned: no step of it runs on.
        assert turn_tasks("stop") == []
        assert not [f for f in await cluster.facts("stop") if f.kind == "assistant"]
        # Given back by the drain itself: released, neither expired nor held.
        assert await lease_state(cluster, "stop") is LeaseState.RELEASED
        lease = await cluster.kernel.get_lease("stop")
        assert lease.lease is None and lease.queued
        # Finished: too late to undo; the runtime is replaced, not revived.
        assert (await old.runtime.undrain()).finished and old.runtime.finished.is_set()
        assert not old.runtime.claiming
    finally:
        await old.stop()

    new = await in_process_runner(cluster).start()
    try:
        await cluster.settled("stop")
    finally:
        await new.stop()
    facts = await cluster.facts("stop")
    assert_recovered(facts)
    epochs = [f.data["epoch"] for f in facts if f.kind == "epoch_started"]
    [final] = finals(facts)
    assert final.data["inputSeqs"] == [seq] and final.epoch == epochs[-1] == epochs[0] + 1
    [handoff] = [h for h in await cluster.kernel.list_handoffs() if h.session_id == "stop"]
    assert (handoff.old_runtime_id, handoff.new_runtime_id) == (old.runtime_id, new.runtime_id)


async def test_after_a_lost_lease_no_task_of_the_attempt_outlives_it(cluster: Cluster) -> None:
    # Renewals every half second, so the loss is noticed soon.
    runner = await in_process_runner(
        cluster, cluster.settings.with_overrides(lease_ms=1500)
    ).start()
    try:
        await cluster.new_session("lost")
        await cluster.send("lost", "/slow 30 an answer that takes a long while", "r1")
        await wait_for_kind(cluster, "lost", "epoch_started")
        assert runner.runtime is not None and turn_tasks("lost")
        # Another runtime takes the session over: the kernel hands the runner
        # no more work, its lease ends, and a successor claims and fences.
        kernel = cluster.kernel
        await kernel.set_drain(runner.runtime_id, "handoff")
        await kernel.register_runtime("successor", "", pid=os.getpid())
        await asyncio.to_thread(leases(cluster).expire_runtime, runner.runtime_id)
        lease = await kernel.claim("successor", wait_ms=5_000)
        assert lease is not None and lease.session_id == "lost"
        await cluster.ledger.append_one(
            "lost",
            "epoch_started",
            {"epoch": lease.epoch, "runtimeId": "successor", "attemptId": "a", "watermark": 2},
            epoch=lease.epoch,
        )

        async def attempt_over() -> bool | None:
            assert runner.runtime is not None
            return True if not runner.runtime.in_flight else None

        await eventually(attempt_over, "the runner to notice its lost lease", 30)
        assert turn_tasks("lost") == [], "the turn task outlived its attempt"
    finally:
        await runner.stop()
    facts = await cluster.facts("lost")
    assert not [f for f in facts if f.kind == "assistant"], "the old attempt committed"


@pytest.mark.slow
async def test_a_handoff_audits_only_real_handoffs_with_successor_and_revision(
    cluster: Cluster,
) -> None:
    revision = await cluster.kernel.put_loadout("default", {"systemPrompt": "Be brief."})
    # Drains itself mid-stream of a final answer: the answer is done there.
    done = cluster.start_runner(KEEL_FAULT_POINT="mid_stream", KEEL_FAULT_ACTION="drain")
    await cluster.runner_ready(done)
    await cluster.new_session("done")
    await cluster.send("done", "/slow 1 the whole answer", "r1")
    await done.line(lambda line: line == "FAULT mid_stream", 60)
    assert await asyncio.to_thread(done.proc.wait, 60) == 0

    # Drains itself right after the tool calls are committed: work is owed.
    owing = cluster.start_runner(
        KEEL_FAULT_POINT="after_assistant_commit", KEEL_FAULT_ACTION="drain"
    )
    await cluster.runner_ready(owing)
    await cluster.new_session("owed")
    await cluster.send("owed", TOOLS % ("owed", "owed"), "r1")
    await owing.line(lambda line: line == "FAULT after_assistant_commit", 60)
    assert await asyncio.to_thread(owing.proc.wait, 60) == 0, "a drained runner exits 0"

    successor = cluster.start_runner()
    await cluster.runner_ready(successor)
    await cluster.settled("owed")
    await cluster.settled("done")
    owed_facts = await cluster.facts("owed")
    assert_recovered(owed_facts)
    by_epoch = {
        f.data["epoch"]: f.data["runtimeId"] for f in owed_facts if f.kind == "epoch_started"
    }
    handoffs = await cluster.kernel.list_handoffs()
    assert [h.session_id for h in handoffs] == ["owed"], "a row only where work was owed"
    [row] = handoffs
    assert row.new_runtime_id == by_epoch[row.epoch + 1] != by_epoch[row.epoch]
    assert (row.loadout_revision, row.in_flight) == (revision, 1)
    done_facts = await cluster.facts("done")
    assert len({f.epoch for f in done_facts if f.kind == "assistant"}) == 1
    assert await lease_state(cluster, "done") is LeaseState.FINISHED


@pytest.mark.slow
async def test_a_drain_not_finished_is_undone_and_a_finished_one_is_not(
    cluster: Cluster,
) -> None:
    child = cluster.start_runner()
    address = await cluster.runner_ready(child)
    await cluster.new_session("undo")
    seq = await cluster.send("undo", "/slow 8 one two three four five six seven eight", "r1")
    await wait_for_kind(cluster, "undo", "epoch_started")
    async with RunnerClient(address, cluster.settings) as runner:
        draining = asyncio.create_task(runner.drain_outcome("handoff", deadline_ms=120_000))

        async def kernel_knows(mode: str) -> bool | None:
            runtimes = await cluster.kernel.list_runtimes()
            return True if any(r.drain_mode == mode for r in runtimes) else None

        await eventually(lambda: kernel_knows("handoff"), "the drain to be registered")
        undone = await runner.drain_outcome("none")
        assert undone.undone and not undone.finished
        assert (await draining).undone, "the drain in progress ends, undone"
        status = await runner.status()
        assert status.claiming and status.drain_mode == "none"
        await eventually(lambda: kernel_knows("none"), "the kernel to know it claims again")

        await cluster.settled("undo")
        facts = await cluster.facts("undo")
        assert [f.kind for f in facts].count("epoch_started") == 1, "no handoff happened"
        assert [f.data["inputSeqs"] for f in finals(facts)] == [[seq]]

        finished = await runner.drain_outcome("handoff", deadline_ms=10_000)
        assert finished.finished and finished.in_flight_runs == 0
    assert await asyncio.to_thread(child.proc.wait, 30) == 0
    assert await cluster.kernel.list_handoffs() == []


@pytest.mark.slow
async def test_sigterm_hands_off_within_keel_drain_deadline_ms(cluster: Cluster) -> None:
    child = cluster.start_runner(KEEL_SIGTERM_MODE="handoff", KEEL_DRAIN_DEADLINE_MS="1000")
    await cluster.runner_ready(child)
    await cluster.new_session("sigterm")
    await cluster.send("sigterm", "/slow 3600 an answer for the next hour", "r1")
    await wait_for_kind(cluster, "sigterm", "epoch_started")
    child.proc.send_signal(signal.SIGTERM)
    # Well under the 30 s default deadline: the variable set it to 1 s.
    assert await asyncio.to_thread(child.proc.wait, 20) == 0, child.output()
    assert await lease_state(cluster, "sigterm") is LeaseState.RELEASED
    [row] = await cluster.kernel.list_handoffs()
    assert (row.session_id, row.in_flight, row.new_runtime_id) == ("sigterm", 1, "")


def test_drain_deadline_and_advertise_address_come_from_the_environment() -> None:
    config = RunnerConfig.from_env(
        "l:1", "k:2", {"KEEL_DRAIN_DEADLINE_MS": "4500", "KEEL_ADVERTISE_ADDRESS": "10.1.2.3"}
    )
    assert (config.handoff_deadline_ms, config.advertise_address) == (4500, "10.1.2.3")
    assert RunnerConfig.from_env("l:1", "k:2", {}).handoff_deadline_ms == 30_000
    with pytest.raises(ValueError, match="KEEL_DRAIN_DEADLINE_MS"):
        RunnerConfig.from_env("l:1", "k:2", {"KEEL_DRAIN_DEADLINE_MS": "soon"})


def test_the_registered_address_is_the_one_listened_on_or_advertised() -> None:
    assert advertised_address("10.1.2.3:7105", 7105) == "10.1.2.3:7105"
    assert advertised_address("127.0.0.2:0", 40001) == "127.0.0.2:40001"
    assert advertised_address("0.0.0.0:7105", 7105, "10.1.2.3") == "10.1.2.3:7105"
    assert advertised_address("0.0.0.0:0", 40001, "runner-0.keel:7000") == "runner-0.keel:7000"
    assert advertised_address("[::]:0", 40001, "[fd00::5]") == "[fd00::5]:40001"
    with pytest.raises(ValueError, match="--advertise-address"):
        check_addresses("0.0.0.0:7105")
    with pytest.raises(ValueError, match="host:port"):
        check_addresses("7105")
    for wrong in ("0.0.0.0", "10.1.2.3:port", "0.0.0.0:7105"):
        with pytest.raises(ValueError, match="--advertise-address"):
            check_addresses("0.0.0.0:7105", wrong)


def test_handoff_rows_name_the_successor_in_the_claim_and_stale_runtimes_are_detached(
    settings: Settings,
) -> None:
    stores = open_stores(settings)
    try:
        stores.register("old", "new", "other")
        stores.tenants.create_tenant("t", "")
        stores.leases.enqueue("s", "t", 1, False)
        first = stores.leases.claim("old")
        assert first is not None
        note = HandoffNote(in_flight=3, loadout_revision=7)
        stores.leases.release("s", first.epoch, "old", note)
        stores.leases.release("s", first.epoch, "old", note)  # a retry writes no second row
        [row] = stores.registry.list_handoffs(10)
        assert (row.old_runtime_id, row.new_runtime_id, row.epoch) == ("old", "", first.epoch)
        # Granted to the draining runtime once more, which hands it straight back.
        again = stores.leases.claim("old")
        assert again is not None
        stores.leases.release("s", again.epoch, "old")
        assert stores.registry.list_handoffs(10)[0].new_runtime_id == ""
        second = stores.leases.claim("new")
        assert second is not None and second.epoch == first.epoch + 2
        stores.leases.finish("s", second.epoch, "new", 1)
        stores.leases.enqueue("s", "t", 2, False)
        assert stores.leases.claim("other") is not None  # after a finish: no handoff
        [row] = stores.registry.list_handoffs(10)
        assert (row.new_runtime_id, row.in_flight, row.loadout_revision) == ("new", 3, 7)

        stores.registry.register(Registration("live", pid=2))
        stores.registry.set_attached("live", True)
        stores.clock.advance(STALE_AFTER_MS)
        stores.registry.touch("live")
        stores.registry.set_attached("other", True)
        stores.clock.advance(1)
        attached = {
            r.runtime_id: r.attached for r in stores.registry.list_runtimes(stores.leases.held_by)
        }
        assert attached["live"] and attached["other"]
        stores.clock.advance(STALE_AFTER_MS)
        stores.registry.touch("live")
        attached = {
            r.runtime_id: r.attached for r in stores.registry.list_runtimes(stores.leases.held_by)
        }
        assert attached["live"], "touched while attached"
        assert not attached["other"], "attached, but not heard of since: its kernel died with it"
    finally:
        stores.database.close()
