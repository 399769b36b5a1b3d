"""Accepting an input never waits behind admission (issue 25, point 6).

A tenant's slot counter is one row every claim, finish and release of the
tenant locks in turn; under a run backlog it is a queue. A claim used to
lock its candidate sessions' rows first and then wait there for the
counter, so an Enqueue of one of those sessions (the wake-up an input's
POST waits for) waited behind the whole admission queue. Here the counter
is held by another transaction, as a finish in progress holds it, while a
claim waits for it: the Enqueue of the claim's candidate must still commit.

PostgreSQL only: SQLite has no row locks (its writers take turns on the file).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg import sql

from kernel import KernelClient, KernelServer
from services.common.config import Settings
from tests.support.kernel_stores import FAST, LONG_TTL_MS
from tests.support.polling import eventually

TENANT = "tenant-backlog"
SESSION = "session-backlog"

# Backends of this test's schema waiting for a lock, with what they run.
_WAITING = """
SELECT query FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()
"""


@pytest.fixture
async def kernel_on_pg(pg_settings: Settings) -> AsyncIterator[KernelServer]:
    long_ttl = pg_settings.with_overrides(lease_ms=LONG_TTL_MS)
    server = await KernelServer(long_ttl, config=FAST).start()
    yield server
    await server.stop()


async def _waiting(url: str, schema: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        rows = await (await conn.execute(_WAITING)).fetchall()
    return [str(row[0]) for row in rows]


async def _lock_waits(check: asyncio.Future[None] | None, url: str, schema: str) -> list[str]:
    """The lock waits, once one is on the tenant's counter (check None), or
    once `check` is done or a wait on a session row shows up."""
    seen: list[str] = []

    async def probe() -> list[str] | None:
        seen[:] = waits = await _waiting(url, schema)
        if check is None:
            return waits if any("kernel_slots" in q for q in waits) else None
        return waits if check.done() or any("kernel_sessions" in q for q in waits) else None

    what = "a lock wait on the tenant's counter" if check is None else "the enqueue or a row wait"
    return await eventually(probe, what, detail=lambda: f"lock waits: {seen}")


async def test_enqueue_commits_while_a_claim_waits_for_the_tenant_counter(
    kernel_on_pg: KernelServer,
) -> None:
    settings = kernel_on_pg.settings
    url, schema = settings.database_url, settings.pg_schema
    async with KernelClient(kernel_on_pg.target, settings) as client:
        await client.register_runtime("runner-backlog")
        await client.enqueue(SESSION, TENANT, input_seq=1)
        # Another transaction of the tenant's admission (a finish giving its
        # slot back, say) holds the counter row.
        holder = await psycopg.AsyncConnection.connect(url)
        try:
            await holder.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            await holder.execute(
                "UPDATE kernel_slots SET in_use = in_use WHERE tenant_id = %s", (TENANT,)
            )
            claiming = asyncio.ensure_future(client.claim("runner-backlog", wait_ms=0))
            await _lock_waits(None, url, schema)  # the claim waits for the counter
            enqueueing = asyncio.ensure_future(client.enqueue(SESSION, TENANT, input_seq=2))
            waits = await _lock_waits(enqueueing, url, schema)
            # Still held: the Enqueue committed without waiting for admission.
            assert enqueueing.done(), f"Enqueue waits behind the claim: {waits}"
            await enqueueing
            assert not claiming.done()
        finally:
            await holder.rollback()
            await holder.close()
        lease = await claiming
        assert lease is not None and lease.session_id == SESSION
        info = await client.get_lease(SESSION)
        assert info.lease is not None and info.lease.epoch == lease.epoch
