"""Takeover after losing a whole node, and no takeover from a live one.

A node is a kernel process and a runner process attached to it (bench.nodes);
two nodes share one PostgreSQL schema and a ledger in the test's process. The
lease TTL stays at its 30 s default, longer than any deadline here, so only
the runtime heartbeats (kernel.liveness) can make a takeover pass in time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest

from bench.nodes import Node, start_nodes
from bench.takeover import TENANT, lose_owner_node
from kernel import KernelClient, KernelConfig, KernelServer
from kernel.database import Database
from kernel.liveness import LivenessStore
from kernel.registry import Registration, RegistryStore
from kernel.store import LeaseStore, now_ms
from kernel.tenancy import TenantStore
from services.common.config import DEFAULT_LEASE_MS, Settings
from services.common.runtime_records import records_dir
from services.ledger import LedgerClient, LedgerServer
from tests.support.polling import eventually

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow

# Fast heartbeats, so the test waits a second for a death, not three.
FAST_LIVENESS = {"KEEL_RUNTIME_HEARTBEAT_MS": "200", "KEEL_RUNTIME_DEAD_AFTER_MS": "1000"}
# Well under the TTL: a takeover that waited for it fails the test.
TAKEOVER_DEADLINE_S = 20.0


@pytest.fixture
def ttl_settings(pg_settings: Settings) -> Settings:
    return dataclasses.replace(pg_settings, lease_ms=DEFAULT_LEASE_MS)


async def test_a_lost_node_s_busy_session_is_taken_and_finished_by_the_other_node(
    ttl_settings: Settings,
) -> None:
    settings = ttl_settings
    ledger_server = await LedgerServer(settings).start()
    ledger = LedgerClient(ledger_server.target, settings)
    nodes: list[Node] = []
    try:
        nodes = await start_nodes(
            ["node-a", "node-b"], ledger_server.target, settings, env=FAST_LIVENESS
        )
        async with KernelClient(nodes[0].kernel_target, settings) as kernel:
            await kernel.create_tenant(TENANT, "Default tenant")
        takeover, lost, survivor = await asyncio.wait_for(
            lose_owner_node(ledger, nodes, settings, "s-lost"), TAKEOVER_DEADLINE_S
        )
        print(f"\nnode loss -> successor's first commit: {takeover.ms:.0f} ms")
        assert takeover.victim in lost.runners
        assert takeover.successor in survivor.runners
        assert await lost.reap() == [-9, -9]

        async with KernelClient(survivor.kernel_target, settings) as kernel:
            # The successor answers in full; the lost runner is not attached.
            async def answered() -> bool | None:
                facts = await ledger.read_all("s-lost")
                last = max(f.epoch for f in facts if f.kind == "epoch_started")
                done = [f for f in facts if f.kind == "assistant" and f.epoch == last]
                return True if done else None

            await eventually(answered, "the successor's answer", TAKEOVER_DEADLINE_S)
            runtimes = {r.runtime_id: r.attached for r in await kernel.list_runtimes()}
            assert runtimes == {takeover.victim: False, takeover.successor: True}
    finally:
        for node in nodes:
            node.kill()
            await node.reap()
        await ledger.close()
        await ledger_server.stop(grace=0.5)


LIVENESS = KernelConfig(
    recheck_ms=50, sweep_ms=50, runtime_heartbeat_ms=50, runtime_dead_after_ms=300
)


async def test_another_kernel_buries_a_stopped_kernel_s_runtime_never_a_live_one(
    ttl_settings: Settings,
) -> None:
    settings = ttl_settings
    live_kernel = await KernelServer(settings, config=LIVENESS).start()
    gone_kernel = await KernelServer(settings, config=LIVENESS).start()
    watcher = await KernelServer(settings, config=LIVENESS).start()
    live = KernelClient(live_kernel.target, settings)
    gone = KernelClient(gone_kernel.target, settings)
    observer = KernelClient(watcher.target, settings)
    attachments = []
    try:
        await observer.create_tenant("t")
        for runtime_id, client, session_id in (
            ("live", live, "s-live"),
            ("orphan", gone, "s-orphan"),
        ):
            await client.register_runtime(runtime_id)
            attachment = client.attach(runtime_id)
            attachments.append(attachment)
            await attachment.wait_connected()
            await observer.enqueue(session_id, "t", input_seq=1)
            lease = await client.claim(runtime_id, wait_ms=5_000)
            assert lease is not None and lease.session_id == session_id
        live_lease = (await observer.get_lease("s-live")).lease
        assert live_lease is not None

        # The orphan's kernel goes away without expiring anything (as a
        # drained kernel does); nobody beats for the orphan any more.
        await gone_kernel.stop(grace=0.1)
        searchers = [live_kernel.heartbeats, watcher.heartbeats]

        def burials() -> list[tuple[str, list[str]]]:
            return [burial for hb in searchers if hb is not None for burial in hb.buried]

        def rounds() -> int:
            return min(hb.rounds for hb in searchers if hb is not None)

        async def buried() -> int | None:
            return rounds() if burials() else None

        # Either surviving kernel may find the orphan first; the other finds
        # it already buried.
        at_burial = await eventually(buried, "the orphan's burial", 10.0)
        assert burials() == [("orphan", ["s-orphan"])]
        # Many more searches by both, each long after a death would be due.
        await eventually(lambda: _at_least(rounds(), at_burial + 20), "more liveness rounds", 10.0)
        info = await observer.get_lease("s-live")
        assert info.lease is not None, "the live runtime kept its lease"
        assert (info.lease.runtime_id, info.lease.epoch) == ("live", live_lease.epoch)
        assert burials() == [("orphan", ["s-orphan"])]
        runtimes = {r.runtime_id: r.attached for r in await observer.list_runtimes()}
        assert runtimes == {"live": True, "orphan": False}
        # The orphan's session is claimable at once.
        await observer.register_runtime("successor")
        taken = await observer.claim("successor", wait_ms=5_000)
        assert taken is not None and taken.session_id == "s-orphan" and taken.reclaimed
    finally:
        for attachment in attachments:
            await attachment.close()
        for client in (live, gone, observer):
            await client.close()
        for server in (live_kernel, gone_kernel, watcher):
            await server.stop(grace=0.1)


async def _at_least(value: int, minimum: int) -> bool | None:
    return True if value >= minimum else None


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(child.stdout)


async def test_a_restarted_kernel_frees_its_data_dir_s_dead_runtimes_at_once(
    settings: Settings,
) -> None:
    """A restarted `keel up`: its predecessor's runner, recorded in the data
    dir with a pid that is gone, is buried when the kernel starts, though its
    heartbeat is fresh and its lease has most of its 30 s TTL left."""
    settings = dataclasses.replace(settings, lease_ms=DEFAULT_LEASE_MS)
    database = Database(settings)
    try:
        # The predecessor's state, on the real clock: fresh beats, live leases.
        leases, registry = LeaseStore(database, DEFAULT_LEASE_MS), RegistryStore(database)
        TenantStore(database).create_tenant("t", "")
        dead, alive = _dead_pid(), os.getpid()
        here = socket.gethostname()
        # "elsewhere": a process of another host sharing the data dir; its
        # pid means nothing here.
        for runtime_id, host, pid in (
            ("predecessor", here, dead),
            ("neighbour", here, alive),
            ("elsewhere", f"not-{here}", dead),
        ):
            registry.register(Registration(runtime_id, host=host, pid=pid))
            registry.set_attached(runtime_id, True)
            leases.enqueue(f"s-{runtime_id}", "t", 1, False)
            assert leases.claim(runtime_id) is not None
            folder = records_dir(settings.data_dir)
            folder.mkdir(parents=True, exist_ok=True)
            record = {
                "runtimeId": runtime_id,
                "role": "runner",
                "pid": pid,
                "address": "127.0.0.1:1",
            }
            (folder / f"{runtime_id}.json").write_text(json.dumps(record))
    finally:
        database.close()
    server = await KernelServer(settings, config=KernelConfig()).start()
    try:
        async with KernelClient(server.target, settings) as kernel:
            assert (await kernel.get_lease("s-predecessor")).lease is None
            for survivor in ("neighbour", "elsewhere"):
                lease = (await kernel.get_lease(f"s-{survivor}")).lease
                assert lease is not None and lease.runtime_id == survivor
            await kernel.register_runtime("successor")
            taken = await kernel.claim("successor")
            assert taken is not None and taken.session_id == "s-predecessor" and taken.reclaimed
    finally:
        await server.stop(grace=0.1)


def test_heartbeats_are_judged_on_the_database_s_clock_not_a_kernel_s(
    settings: Settings,
) -> None:
    """A kernel whose clock runs an hour ahead takes no live runtime for
    dead; one an hour behind is not fooled into keeping a dead one."""
    database = Database(settings)
    try:
        leases = LeaseStore(database, DEFAULT_LEASE_MS)
        registry = RegistryStore(database)
        TenantStore(database).create_tenant("t", "")
        registry.register(Registration("beating", pid=1))
        registry.set_attached("beating", True)
        leases.enqueue("s", "t", 1, False)
        assert leases.claim("beating") is not None
        hour = 3_600_000
        ahead = LivenessStore(database, leases, clock=lambda: now_ms() + hour)
        behind = LivenessStore(database, leases, clock=lambda: now_ms() - hour)
        assert ahead.stale(1_000) == []
        assert ahead.bury_stale("beating", 1_000) == []
        assert behind.beat(["beating"]) == 1
        assert ahead.stale(hour) == []
        # Five seconds old on the database's clock, whatever the kernels say.
        database.run(
            lambda tx: tx.execute(
                "UPDATE runtime_instances SET beat_at_ms = beat_at_ms - 5000 WHERE runtime_id = %s",
                ("beating",),
            )
        )
        assert behind.stale(1_000) == ["beating"]
        assert behind.bury_stale("beating", 1_000) == ["s"]
        assert behind.stale(1_000) == [], "buried: detached"
    finally:
        database.close()


def test_the_liveness_knobs_come_from_the_environment_and_are_checked() -> None:
    config = KernelConfig.from_env(
        {"KEEL_RUNTIME_HEARTBEAT_MS": "250", "KEEL_RUNTIME_DEAD_AFTER_MS": "1500"}
    )
    assert (config.runtime_heartbeat_ms, config.runtime_dead_after_ms) == (250, 1500)
    assert KernelConfig.from_env({}).runtime_dead_after_ms == 3_000
    with pytest.raises(ValueError, match="KEEL_RUNTIME_DEAD_AFTER_MS"):
        KernelConfig.from_env(
            {"KEEL_RUNTIME_HEARTBEAT_MS": "1000", "KEEL_RUNTIME_DEAD_AFTER_MS": "1500"}
        )
    with pytest.raises(ValueError, match="KEEL_RUNTIME_HEARTBEAT_MS"):
        KernelConfig.from_env({"KEEL_RUNTIME_HEARTBEAT_MS": "soon"})
