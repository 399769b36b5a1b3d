"""The ledger's settlement of a turn (kernel/turn_settlement.py) against the
kernel's own Finish: the same outcome where it settles, nothing where not.

Every combination of what may stand in the way (a stale epoch, another
runtime, an input newer than the answer, a lease past its TTL, a draining
runtime, another session of the tenant waiting, no window asked for) is set
up on the real store, and the function is called as the ledger's statement
calls it. Where nothing stands in the way, the session's row must be what
`kernel.domain.finish` decides for a successful Finish asking for that
window, and the tenant's slot must come back; anywhere else, the row and the
slot counter must be exactly as they were, for the runner's Finish to decide.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kernel import domain
from kernel.domain import DrainMode, LeaseState, SessionRecord
from kernel.sticky import MAX_STICKY_MS
from services.common.config import Settings
from tests.support.kernel_stores import SETTLE, Stores, open_stores

LEASE_MS = 1_000
READ_THROUGH = 3


@dataclass(frozen=True)
class Case:
    stale_epoch: bool
    other_runtime: bool
    newer_input: bool
    expired: bool
    draining: bool
    other_waiting: bool
    sticky_ms: int

    @property
    def settles(self) -> bool:
        return not (
            self.stale_epoch
            or self.other_runtime
            or self.newer_input
            or self.expired
            or self.draining
            or self.other_waiting
            or self.sticky_ms <= 0
        )


CASES = [
    Case(*flags, sticky_ms=sticky_ms)
    for *flags, sticky_ms in itertools.product(
        *([(False, True)] * 6), (0, 5_000, 10 * MAX_STICKY_MS)
    )
]


@pytest.fixture
def stores(pg_settings: Settings) -> Iterator[Stores]:
    opened = open_stores(pg_settings, lease_ms=LEASE_MS)
    yield opened
    opened.database.close()


def _settle(
    stores: Stores, session_id: str, epoch: int, runtime_id: str, sticky_ms: int
) -> dict[str, int]:
    rows = stores.database.run(
        lambda tx: tx.rows(
            SETTLE,
            (
                [session_id],
                [epoch],
                [runtime_id],
                [READ_THROUGH],
                [sticky_ms],
                stores.clock.now,
            ),
        )
    )
    return {str(session): int(until) for session, until in rows}


def _record(stores: Stores, session_id: str) -> SessionRecord:
    record = stores.leases.record(session_id)
    assert record is not None
    return record


def _empty_the_queue(stores: Stores, prefix: str) -> None:
    """Earlier cases' sessions still queued (the waiting ones) are taken
    and finished, so this case's claim takes its own session."""
    sweeper = f"{prefix}-sweeper"
    stores.register(sweeper)
    while (lease := stores.leases.claim(sweeper)) is not None:
        stores.leases.finish(lease.session_id, lease.epoch, sweeper, READ_THROUGH + 1)


def _set_up(stores: Stores, case: Case) -> tuple[str, str, int, str]:
    """A session held by a runtime, with the case's obstacles; its tenant,
    id, the epoch and runtime the settlement names."""
    prefix = uuid.uuid4().hex[:8]
    tenant_id, session_id = f"{prefix}-t", f"{prefix}-s"
    holder, other = f"{prefix}-r", f"{prefix}-other"
    stores.register(holder, other)
    _empty_the_queue(stores, prefix)
    stores.leases.enqueue(session_id, tenant_id, READ_THROUGH, False)
    lease = stores.leases.claim(holder)
    assert lease is not None and lease.session_id == session_id
    if case.newer_input:
        stores.leases.enqueue(session_id, tenant_id, READ_THROUGH + 1, False)
    if case.other_waiting:
        stores.leases.enqueue(f"{prefix}-waiting", tenant_id, 1, False)
    if case.draining:
        stores.registry.set_drain(holder, DrainMode.HANDOFF)
    if case.expired:
        stores.clock.advance(LEASE_MS)
    else:
        stores.clock.advance(LEASE_MS // 2)
    epoch = lease.epoch + 1 if case.stale_epoch else lease.epoch
    return tenant_id, session_id, epoch, other if case.other_runtime else holder


def _check(stores: Stores, case: Case) -> None:
    tenant_id, session_id, epoch, runtime_id = _set_up(stores, case)
    before = _record(stores, session_id)
    slots_before = stores.leases.slots(tenant_id)

    settled = _settle(stores, session_id, epoch, runtime_id, case.sticky_ms)

    after = _record(stores, session_id)
    if not case.settles:
        assert settled == {}
        assert after == before
        assert stores.leases.slots(tenant_id) == slots_before
        return
    transition, result = domain.finish(
        before,
        epoch,
        runtime_id,
        READ_THROUGH,
        False,
        "",
        stores.clock.now,
        stores.leases.policy,
        sticky_ms=min(case.sticky_ms, MAX_STICKY_MS),
        ttl_ms=LEASE_MS,
    )
    assert after == transition.record
    assert after.state is LeaseState.STICKY
    assert settled == {session_id: result.sticky_until_ms}
    in_use, max_runs = slots_before
    assert stores.leases.slots(tenant_id) == (in_use + transition.slot_delta, max_runs)
    assert stores.leases.held_count(tenant_id) == in_use - 1


def test_the_ledger_settles_exactly_what_finish_would_keep(stores: Stores) -> None:
    # One schema for every case (each has ids of its own): a schema per
    # case would cost more than the cases.
    assert sum(case.settles for case in CASES) == 2
    for case in CASES:
        try:
            _check(stores, case)
        except AssertionError as failure:
            raise AssertionError(f"{case}: {failure}") from failure


def test_a_batch_settles_each_session_and_returns_each_slot_once(stores: Stores) -> None:
    """Several sessions of two tenants in one call, as a batch of appends."""
    prefix = uuid.uuid4().hex[:8]
    runtime_id = f"{prefix}-r"
    stores.register(runtime_id)
    sessions = {f"{prefix}-s{i}": f"{prefix}-t{i % 2}" for i in range(6)}
    for session_id, tenant_id in sessions.items():
        stores.leases.enqueue(session_id, tenant_id, 1, False)
    leases = [stores.leases.claim(runtime_id) for _ in sessions]
    assert all(lease is not None for lease in leases)
    epochs = {lease.session_id: lease.epoch for lease in leases if lease is not None}
    ids = sorted(sessions, reverse=True)  # not the order the function locks in
    rows = stores.database.run(
        lambda tx: tx.rows(
            SETTLE,
            (
                ids,
                [epochs[s] for s in ids],
                [runtime_id] * 6,
                [1] * 6,
                [5_000] * 6,
                stores.clock.now,
            ),
        )
    )
    assert {str(r[0]) for r in rows} == set(sessions)
    for tenant_id in set(sessions.values()):
        assert stores.leases.slots(tenant_id)[0] == 0
        assert stores.leases.held_count(tenant_id) == 0
    assert all(_record(stores, s).state is LeaseState.STICKY for s in sessions)
