"""Runtimes gone for longer than the retention are forgotten, on both backends."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

import psycopg
import pytest
from psycopg import sql

from kernel.database import Database
from kernel.expiry import RuntimePruner
from kernel.registry import Registration, RegistryStore
from services.common.config import Settings
from services.common.errors import ServiceUnavailable
from tests.support.kernel_stores import FakeClock, Stores
from tests.support.polling import eventually

RETENTION = 60_000

# `runtime_instances` as the first release created it, before `seen_at_ms`.
OLD_RUNTIME_INSTANCES = """
CREATE TABLE runtime_instances (
    runtime_id TEXT PRIMARY KEY,
    address TEXT NOT NULL,
    host TEXT NOT NULL,
    pid BIGINT NOT NULL,
    loadout_revision BIGINT NOT NULL,
    version TEXT NOT NULL,
    role TEXT NOT NULL,
    drain_mode TEXT NOT NULL,
    attached INTEGER NOT NULL DEFAULT 0,
    started_at_ms BIGINT NOT NULL
)
"""
OLD_ROW = (
    "INSERT INTO runtime_instances (runtime_id, address, host, pid, loadout_revision, "
    "version, role, drain_mode, attached, started_at_ms) "
    "VALUES ('old', '', '', 1, 0, '', 'runner', 'none', 0, 5)"
)


def known(stores: Stores) -> set[str]:
    return {r.runtime_id for r in stores.registry.list_runtimes(stores.leases.held_by)}


def test_a_runtime_that_never_attached_is_forgotten_after_the_retention(stores: Stores) -> None:
    stores.register("r1")
    stores.clock.advance(RETENTION)
    assert stores.registry.prune(RETENTION) == 0, "exactly the retention is not past it"
    stores.clock.advance(1)
    assert stores.registry.prune(RETENTION) == 1
    assert not stores.registry.exists("r1")


def test_an_attached_runtime_is_kept_however_old(stores: Stores) -> None:
    stores.register("r1")
    stores.registry.set_attached("r1", True)
    stores.clock.advance(100 * RETENTION)
    assert stores.registry.prune(RETENTION) == 0
    assert known(stores) == {"r1"}


def test_a_detached_runtime_is_kept_for_the_retention_after_its_detach(stores: Stores) -> None:
    stores.register("r1")
    stores.registry.set_attached("r1", True)
    stores.clock.advance(10 * RETENTION)
    stores.registry.set_attached("r1", False)
    stores.clock.advance(RETENTION)
    assert stores.registry.prune(RETENTION) == 0, "the retention runs from the detach"
    stores.clock.advance(1)
    assert stores.registry.prune(RETENTION) == 1
    assert known(stores) == set()


def test_a_reregistration_restarts_the_retention(stores: Stores) -> None:
    stores.register("r1")
    stores.clock.advance(RETENTION)
    stores.register("r1")
    stores.clock.advance(1)
    assert stores.registry.prune(RETENTION) == 0
    assert stores.registry.exists("r1")


def test_a_runtime_holding_a_lease_is_kept(stores: Stores) -> None:
    stores.register("r1")
    stores.leases.enqueue("s1", "t1", 1, False)
    lease = stores.leases.claim("r1")
    assert lease is not None
    stores.clock.advance(2 * RETENTION)
    assert stores.registry.prune(RETENTION) == 0, "its lease is still held, though past its TTL"
    assert stores.leases.sweep() == 1
    assert stores.registry.prune(RETENTION) == 1
    assert not stores.registry.exists("r1")


def test_prune_counts_only_what_it_deleted(stores: Stores) -> None:
    stores.register("gone-1", "gone-2", "gone-3")
    stores.clock.advance(RETENTION + 1)
    stores.register("fresh")
    stores.register("live")
    stores.registry.set_attached("live", True)
    assert stores.registry.prune(RETENTION) == 3
    assert known(stores) == {"fresh", "live"}
    assert stores.registry.prune(RETENTION) == 0


def _create_first_release_table(settings: Settings) -> None:
    if settings.uses_postgres:
        with psycopg.connect(settings.database_url, autocommit=True) as conn:
            schema = sql.Identifier(settings.pg_schema)
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
            conn.execute(sql.SQL("SET search_path TO {}").format(schema))
            conn.execute(OLD_RUNTIME_INSTANCES.encode())
            conn.execute(OLD_ROW.encode())
        return
    settings.data_dir.mkdir(parents=True)
    with sqlite3.connect(settings.sqlite_path("kernel")) as file:
        file.execute(OLD_RUNTIME_INSTANCES)
        file.execute(OLD_ROW)
    file.close()


def test_a_database_from_before_seen_at_gets_the_column(settings: Settings) -> None:
    _create_first_release_table(settings)
    clock = FakeClock()
    database = Database(settings)
    try:
        registry = RegistryStore(database, clock)
        rows = database.run(
            lambda tx: tx.rows("SELECT runtime_id, seen_at_ms FROM runtime_instances")
        )
        assert rows == [("old", 0)], "the existing row is kept, never seen since"
        registry.register(Registration("new", pid=2))
        assert registry.prune(RETENTION) == 1
        assert not registry.exists("old") and registry.exists("new")
    finally:
        database.close()
    # Opening it again finds the column there and leaves it alone.
    Database(settings).close()


class FailingOnce(RegistryStore):
    """A registry whose first prune finds the store down."""

    def __init__(self, stores: Stores) -> None:
        super().__init__(stores.database, stores.clock)
        self.calls = 0

    def prune(self, retention_ms: int) -> int:
        self.calls += 1
        if self.calls == 1:
            raise ServiceUnavailable("kernel store unavailable: down for the test")
        return super().prune(retention_ms)


async def test_the_pruner_forgets_periodically_and_survives_a_store_error(
    stores: Stores, caplog: pytest.LogCaptureFixture
) -> None:
    stores.register("gone")
    stores.clock.advance(RETENTION + 1)
    registry = FailingOnce(stores)
    task = asyncio.create_task(RuntimePruner(registry, RETENTION, interval_ms=10).run())
    caplog.set_level(logging.INFO, logger="kernel.expiry")
    try:

        async def forgotten() -> bool:
            # The pruner says so once its thread has deleted the row: wait for
            # the line too, or the task may be cancelled between the two.
            if "forgot 1 runtime(s)" not in caplog.text:
                return False
            return not await asyncio.to_thread(stores.registry.exists, "gone")

        await eventually(forgotten, what="the gone runtime is pruned")
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert "runtime pruning failed" in caplog.text
    assert "forgot 1 runtime(s)" in caplog.text
