"""Drain: handoff settles at a commit boundary, shutdown abandons; the session goes on."""

from __future__ import annotations

import asyncio

import pytest

from services.runner.client import RunnerClient
from tests.support.cluster import Cluster, wait_for_kind
from tests.support.ledger_invariants import assert_recovered

pytestmark = pytest.mark.slow

SLOW_TOOLS = '/tool sleep {"seconds": 1} | counter {"key": "%s"} | sleep {"seconds": 1}'


async def test_handoff_settles_at_a_commit_boundary_and_a_successor_continues(
    cluster: Cluster,
) -> None:
    old = cluster.start_runner()
    address = await cluster.runner_ready(old)
    await cluster.new_session("handoff")
    seq = await cluster.send("handoff", SLOW_TOOLS % "handoff", "r1")
    await wait_for_kind(cluster, "handoff", "assistant")

    async with RunnerClient(address, cluster.settings) as runner:
        outcome = await runner.drain_outcome("handoff", deadline_ms=30_000)
    assert outcome.in_flight_runs == 1 and outcome.finished
    assert outcome.stopped_runs == 0, "settled at a boundary, not stopped at the deadline"
    # Drained: the runner is replaced, never revived; it exits on its own.
    assert await asyncio.to_thread(old.proc.wait, 30) == 0

    facts = await cluster.facts("handoff")
    old_epoch = max(f.data["epoch"] for f in facts if f.kind == "epoch_started")
    # Stopped at a boundary: the tool batch is not finished, nothing half-written.
    assert sum(f.kind == "tool_result" for f in facts) < 3
    lease = await cluster.kernel.get_lease("handoff")
    assert lease.lease is None and lease.queued, "released, and claimable at once"

    new = cluster.start_runner()
    await cluster.runner_ready(new)
    await cluster.settled("handoff")
    facts = await cluster.facts("handoff")
    assert_recovered(facts)
    starts = [f.data["epoch"] for f in facts if f.kind == "epoch_started"]
    assert starts[-1] == old_epoch + 1
    starts_by = {f.data["epoch"]: f.data["runtimeId"] for f in facts if f.kind == "epoch_started"}
    finals = [f for f in facts if f.kind == "assistant" and f.data.get("inputSeqs")]
    assert [f.data["inputSeqs"] for f in finals] == [[seq]]
    handoffs = await cluster.kernel.list_handoffs()
    [handoff] = [h for h in handoffs if h.session_id == "handoff"]
    assert handoff.epoch == old_epoch and handoff.in_flight == 1
    assert handoff.new_runtime_id == starts_by[old_epoch + 1]


async def test_shutdown_drain_abandons_and_a_successor_continues(cluster: Cluster) -> None:
    old = cluster.start_runner()
    await cluster.runner_ready(old)
    await cluster.new_session("shutdown")
    seq = await cluster.send("shutdown", "/slow 3 an answer that takes a while", "r1")
    await wait_for_kind(cluster, "shutdown", "epoch_started")

    # SIGTERM: drain in shutdown mode, then exit (waited for off the event loop,
    # which also serves the kernel the runner talks to while draining).
    assert await asyncio.to_thread(old.terminate) == 0
    new = cluster.start_runner()
    await cluster.runner_ready(new)
    await cluster.settled("shutdown")
    facts = await cluster.facts("shutdown")
    assert_recovered(facts)
    finals = [f for f in facts if f.kind == "assistant" and f.data.get("inputSeqs")]
    assert [f.data["inputSeqs"] for f in finals] == [[seq]]
    assert len([f for f in facts if f.kind == "epoch_started"]) == 2
