"""Per-tenant admission slots: one counter row per tenant in `kernel_slots`.

A tenant may run at most `max_runs` sessions at once (its loadout's
`maxConcurrentRuns`, default 8). `in_use` is changed only in the same
transaction as the lease rows it counts, so it always equals the number of
the tenant's held leases; the conditional increment below is the admission
check, and two claims racing for a tenant's last slot serialize on the
counter row so only one wins. These functions run inside a store
transaction.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from kernel import domain
from kernel.database import Tx


def ensure_counter(tx: Tx, tenant_id: str) -> None:
    """Creates the tenant's counter, limited by its latest loadout."""
    if tx.one("SELECT 1 FROM kernel_slots WHERE tenant_id = %s", (tenant_id,)):
        return
    latest = tx.one(
        "SELECT document FROM loadouts WHERE tenant_id = %s ORDER BY revision DESC LIMIT 1",
        (tenant_id,),
    )
    max_runs = domain.DEFAULT_MAX_RUNS
    if latest is not None:
        max_runs = domain.max_runs_of(json.loads(latest[0]))
    tx.execute(
        "INSERT INTO kernel_slots (tenant_id, in_use, max_runs) VALUES (%s, 0, %s) "
        "ON CONFLICT (tenant_id) DO NOTHING",
        (tenant_id, max_runs),
    )


def set_limit(tx: Tx, tenant_id: str, max_runs: int) -> None:
    tx.execute(
        "INSERT INTO kernel_slots (tenant_id, in_use, max_runs) VALUES (%s, 0, %s) "
        "ON CONFLICT (tenant_id) DO UPDATE SET max_runs = excluded.max_runs",
        (tenant_id, max_runs),
    )


def take(tx: Tx, tenant_id: str) -> bool:
    """Takes one slot if the tenant has one free."""
    for _ in range(2):
        taken = tx.one(
            "UPDATE kernel_slots SET in_use = in_use + 1 "
            "WHERE tenant_id = %s AND in_use < max_runs RETURNING in_use",
            (tenant_id,),
        )
        if taken is not None:
            return True
        if tx.one("SELECT 1 FROM kernel_slots WHERE tenant_id = %s", (tenant_id,)):
            return False
        # Enqueue creates the counter; a session older than its counter
        # (a repaired table) gets one here.
        ensure_counter(tx, tenant_id)
    return False


# A tenant's free slots, and how many of its other sessions are queued and
# due, counted up to MAX_COUNTED (past that, waiting outnumbers any tenant's
# free slots in practice). The tenant is named, or read from the session.
MAX_COUNTED = 1000
_SPARE = (
    "SELECT t.max_runs - t.in_use, (SELECT COUNT(*) FROM (SELECT 1 FROM kernel_sessions s "
    "WHERE s.queued = 1 AND s.parked = 0 AND s.state <> 'held' AND s.not_before_ms <= %s "
    "AND s.tenant_id = t.tenant_id AND s.session_id <> %s LIMIT %s) w) "
    "FROM kernel_slots t WHERE t.tenant_id = {tenant}"
)
_SPARE_OF_TENANT = _SPARE.format(tenant="%s")
_SPARE_OF_SESSION = _SPARE.format(
    tenant="(SELECT tenant_id FROM kernel_sessions WHERE session_id = %s)"
)


def spare(tx: Tx, session_id: str, now_ms: int, tenant_id: str = "") -> int:
    """`free - waiting` of `free_and_waiting`."""
    free, waiting = free_and_waiting(tx, session_id, now_ms, tenant_id)
    return free - waiting


def free_and_waiting(tx: Tx, session_id: str, now_ms: int, tenant_id: str = "") -> tuple[int, int]:
    """The free slots of `session_id`'s tenant (`tenant_id`, when the caller
    knows it), and how many of its other sessions are queued and due.

    A wake and a lease held on for the next input skip the queue. Where the
    queue's sessions wait for a slot, skipping would take that slot from
    them, turn after turn while inputs keep coming; so a wake needs a spare
    slot (>= 1) and holding on needs none taken from anyone (>= 0). Sessions
    queued only until a claim loop reaches them, with slots to spare, are
    not held back by either. One statement: this is on every warm turn."""
    if tenant_id:
        row = tx.one(_SPARE_OF_TENANT, (now_ms, session_id, MAX_COUNTED, tenant_id))
    else:
        row = tx.one(_SPARE_OF_SESSION, (now_ms, session_id, MAX_COUNTED, session_id))
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


def adjust(tx: Tx, deltas: Mapping[str, int]) -> None:
    """Applies slot changes in tenant order: every transaction touching
    several counters locks them in the same order, so none deadlock."""
    for tenant_id in sorted(deltas):
        if deltas[tenant_id]:
            tx.execute(
                "UPDATE kernel_slots SET in_use = in_use + %s WHERE tenant_id = %s",
                (deltas[tenant_id], tenant_id),
            )


def recount(tx: Tx) -> dict[str, tuple[int, int]]:
    """Sets every counter to the tenant's held leases; {tenant: (was, is)}
    of the counters that were wrong."""
    tx.execute(
        "INSERT INTO kernel_slots (tenant_id, in_use, max_runs) "
        "SELECT DISTINCT tenant_id, 0, %s FROM kernel_sessions WHERE true "
        "ON CONFLICT (tenant_id) DO NOTHING",
        (domain.DEFAULT_MAX_RUNS,),
    )
    # Lock every counter first: claims and releases wait on them, so the
    # count below sees a settled set of held leases.
    counters = tx.rows("SELECT tenant_id, in_use FROM kernel_slots ORDER BY tenant_id {lock}")
    held: dict[str, int] = dict(
        tx.rows(
            "SELECT tenant_id, COUNT(*) FROM kernel_sessions "
            "WHERE state = 'held' GROUP BY tenant_id"
        )
    )
    repairs: dict[str, tuple[int, int]] = {}
    for tenant_id, in_use in counters:
        actual = int(held.get(tenant_id, 0))
        if int(in_use) != actual:
            repairs[tenant_id] = (int(in_use), actual)
            tx.execute(
                "UPDATE kernel_slots SET in_use = %s WHERE tenant_id = %s", (actual, tenant_id)
            )
    return repairs


def usage(tx: Tx, tenant_id: str) -> tuple[int, int]:
    """(in use, max) of a tenant's slots."""
    row = tx.one("SELECT in_use, max_runs FROM kernel_slots WHERE tenant_id = %s", (tenant_id,))
    return (0, domain.DEFAULT_MAX_RUNS) if row is None else (int(row[0]), int(row[1]))
