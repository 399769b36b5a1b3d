"""The kernel against real OS processes: kernel replicas racing for
sessions, a SIGKILLed lease holder, and reconciliation with a real ledger."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import pytest

from kernel import EpochSuperseded, KernelClient, KernelServer
from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer
from tests.support.databases import settings_env
from tests.support.kernel_stores import FAST, LONG_TTL_MS
from tests.support.polling import eventually
from tests.support.processes import ChildProcess

pytestmark = pytest.mark.slow


async def _wait_line(child: ChildProcess, text: str, within: float = 60.0) -> str:
    return await asyncio.to_thread(child.wait_for_line, lambda line: text in line, within)


async def test_kernel_replicas_in_separate_processes_never_share_a_session(
    pg_settings: Settings, tmp_path: Path
) -> None:
    settings = pg_settings.with_overrides(lease_ms=LONG_TTL_MS)
    sessions = [f"s{n:03d}" for n in range(150)]
    # The parent's own replica creates the schema and fills the queue.
    server = await KernelServer(settings, config=FAST).start()
    children: list[ChildProcess] = []
    try:
        async with KernelClient(server.target, server.settings) as client:
            await client.create_tenant("t1")
            await client.put_loadout("t1", {"maxConcurrentRuns": 1000})
            for session in sessions:
                await client.enqueue(session, "t1", input_seq=1)
        go_file = tmp_path / "go"
        env = settings_env(settings)
        children = [
            ChildProcess.python("-m", "tests.kernel.claimer_process", str(n), str(go_file), env=env)
            for n in range(3)
        ]
        for child in children:
            await _wait_line(child, "ready")
        go_file.touch()
        for child in children:
            await _wait_line(child, "done")
            assert await asyncio.to_thread(child.proc.wait, 30) == 0, child.output()
        async with KernelClient(server.target, server.settings) as client:
            for session in sessions[::10]:
                info = await client.get_lease(session)
                assert not info.queued and info.lease is None
    finally:
        for child in children:
            child.kill()
        await server.stop()

    claims: dict[str, list[int]] = defaultdict(list)
    claimed_by: dict[int, int] = {}
    for n, child in enumerate(children):
        lines = child.lines
        assert not [line for line in lines if line.startswith("lost ")], child.output()
        for line in lines:
            if line.startswith("claimed "):
                _, session, epoch = line.split()
                claims[session].append(int(epoch))
                claimed_by[n] = claimed_by.get(n, 0) + 1
    assert sorted(claims) == sessions
    for session, epochs in claims.items():
        assert sorted(epochs) == list(range(1, len(epochs) + 1)), (session, epochs)
    assert len(claimed_by) == 3, f"every replica should have won some claims: {claimed_by}"


async def test_a_sigkilled_holder_is_taken_over_through_the_fast_path(
    pg_settings: Settings,
) -> None:
    # A 10-minute TTL: only the fast path can explain a takeover in this test.
    settings = pg_settings.with_overrides(lease_ms=LONG_TTL_MS)
    server = await KernelServer(settings, config=FAST).start()
    holder: ChildProcess | None = None
    try:
        async with KernelClient(server.target, server.settings) as client:
            for session in ("k1", "k2"):
                await client.enqueue(session, "t1", input_seq=1)
            await client.register_runtime("successor")
            holder = ChildProcess.python(
                "-m",
                "bench.kernel_holder",
                server.target,
                "holder",
                "--sessions",
                "2",
                env=settings_env(settings),
            )
            await _wait_line(holder, "holder ready")
            held = {
                line.split()[1]: int(line.split()[2])
                for line in holder.lines
                if line.startswith("holding ")
            }
            assert sorted(held) == ["k1", "k2"]
            [runtime] = [r for r in await client.list_runtimes() if r.runtime_id == "holder"]
            assert runtime.attached and sorted(runtime.session_ids) == ["k1", "k2"]
            assert await client.claim("successor") is None, "the holder's leases are live"

            waiting = [
                asyncio.create_task(client.claim("successor", wait_ms=120_000)) for _ in held
            ]
            holder.kill()
            taken = [await asyncio.wait_for(task, 60) for task in waiting]

            assert sorted(lease.session_id for lease in taken if lease) == ["k1", "k2"]
            for lease in taken:
                assert lease is not None
                assert lease.reclaimed, "the previous lease expired, it was not released"
                assert lease.epoch == held[lease.session_id] + 1
                assert lease.expires_at_ms > 0
            assert server.leases is not None and server.attachments is not None
            for session in held:
                record = await asyncio.to_thread(server.leases.record, session)
                assert record is not None and record.expired_by == "disconnect"
            totals = server.metrics.totals()
            assert totals["expirations_disconnect"] == 2
            assert "expirations_ttl" not in totals
            assert [(rid, sorted(s)) for rid, s in server.attachments.takeovers] == [
                ("holder", ["k1", "k2"])
            ]
            with pytest.raises(EpochSuperseded):
                await client.renew("k1", held["k1"], "holder")
            await eventually(lambda: _detached(client, "holder"), what="holder detached")
    finally:
        if holder is not None:
            holder.kill()
        await server.stop()


async def _detached(client: KernelClient, runtime_id: str) -> bool:
    runtimes = {r.runtime_id: r for r in await client.list_runtimes()}
    return not runtimes[runtime_id].attached and not runtimes[runtime_id].session_ids


async def test_reconciliation_enqueues_a_session_whose_wake_up_was_lost(
    settings: Settings,
) -> None:
    ledger = await LedgerServer(settings).start()
    kernel: KernelServer | None = None
    try:
        async with LedgerClient(ledger.target, ledger.settings) as writer:
            await writer.create_session("quiet", "t1")
            await writer.create_session("lost-wakeup", "t1")
            await writer.append_one("lost-wakeup", "input", {"text": "hi", "requestId": "r1"})
        # Nobody called Enqueue: only reconciliation can find the session.
        kernel = await KernelServer(settings, ledger_target=ledger.target, config=FAST).start()
        async with KernelClient(kernel.target, kernel.settings) as client:
            await client.register_runtime("r1")
            lease = await client.claim("r1", wait_ms=60_000)
            assert lease is not None
            assert (lease.session_id, lease.tenant_id, lease.epoch) == ("lost-wakeup", "t1", 1)
            assert not (await client.get_lease("quiet")).queued
            assert kernel.reconciler is not None and kernel.reconciler.enqueued >= 1
            # A leased session is not enqueued again behind its owner's back.
            passes = kernel.reconciler.passes
            await eventually(
                lambda: _passes_beyond(kernel, passes + 2), what="two more reconciliations"
            )
            info = await client.get_lease("lost-wakeup")
            assert info.lease is not None and info.lease.epoch == 1
    finally:
        if kernel is not None:
            await kernel.stop()
        await ledger.stop()


async def _passes_beyond(kernel: KernelServer, passes: int) -> bool:
    assert kernel.reconciler is not None
    return kernel.reconciler.passes >= passes
