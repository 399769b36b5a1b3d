"""A session row of the lease tables, and how a decided transition is written.

Every lease operation (the queue's, the holder's, the expiry's) loads a
`kernel_sessions` row, lets `kernel.domain` decide, writes the row and its
tenant's slot counter in the same transaction, and wakes the waiting claims
after the commit when the change may have made a session claimable. That
shared machinery lives here, apart from the operations, so each group of
operations (`kernel.lease_queue`, `kernel.lease_ends`, `kernel.store`) reads
as what it decides rather than how a row is stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import astuple, fields
from enum import Enum

from kernel import admission, domain
from kernel.database import Database, Row, Tx
from kernel.domain import LeaseState, RetryPolicy, SessionRecord, Transition
from kernel.metrics import KernelMetrics

Clock = Callable[[], int]

COLUMNS = [f.name for f in fields(SessionRecord)]
# Every column of a session row; callers add the WHERE clause.
SELECT_SESSIONS = f"SELECT {', '.join(COLUMNS)} FROM kernel_sessions s"
_UPDATE = (
    f"UPDATE kernel_sessions SET {', '.join(f'{c} = %s' for c in COLUMNS[1:])} "
    "WHERE session_id = %s"
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def session_record(row: Row) -> SessionRecord:
    """A row selected with `SELECT_SESSIONS`, as the domain's record."""
    values = dict(zip(COLUMNS, row, strict=True))
    values["queued"] = bool(values["queued"])
    values["parked"] = bool(values["parked"])
    values["state"] = LeaseState(values["state"])
    return SessionRecord(**values)


def _params(record: SessionRecord) -> list[object]:
    out: list[object] = []
    for value in astuple(record)[1:]:
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, Enum):
            # Plain text in the table, whatever a driver does with enums.
            value = value.value
        out.append(value)
    out.append(record.session_id)
    return out


def _may_unblock(done: Sequence[Transition], slot_waiters: bool) -> bool:
    # A row's last transition is what it is now (an Enqueue's queueing and
    # the wake that follows it in the same transaction are one change).
    now_is = {t.record.session_id: t.record for t in done}
    changed = {t.record.session_id for t in done if t.changed and t.event is not domain.Event.RENEW}
    for session_id in changed:
        record = now_is[session_id]
        if record.queued and not record.parked and record.state is not LeaseState.HELD:
            return True  # claimable now, or once its not_before passes
    return slot_waiters and any(t.slot_delta < 0 for t in done)


class LeaseRows:
    """The lease store's state and its row writes; the operations are in
    the classes built on it (`kernel.store.LeaseStore` gathers them)."""

    def __init__(
        self,
        database: Database,
        lease_ms: int,
        policy: RetryPolicy | None = None,
        metrics: KernelMetrics | None = None,
        clock: Clock = now_ms,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._db = database
        self.lease_ms = lease_ms
        self.policy = policy or RetryPolicy()
        self.metrics = metrics or KernelMetrics()
        self._clock = clock
        # Called after any commit that may have made a session claimable.
        self._on_change = on_change or (lambda: None)

    def _load(self, tx: Tx, session_id: str) -> SessionRecord | None:
        row = tx.one(f"{SELECT_SESSIONS} WHERE s.session_id = %s {{lock}}", (session_id,))
        return None if row is None else session_record(row)

    def _create(self, tx: Tx, session_id: str, tenant_id: str) -> SessionRecord:
        """The session's new row (or the one a racing transaction just made)."""
        tx.execute(
            "INSERT INTO kernel_sessions (session_id, tenant_id) VALUES (%s, %s) "
            "ON CONFLICT (session_id) DO NOTHING",
            (session_id, tenant_id),
        )
        record = self._load(tx, session_id)
        assert record is not None
        return record

    def _apply(
        self,
        tx: Tx,
        transition: Transition,
        done: list[Transition],
        slots: bool = True,
        write: bool = True,
    ) -> None:
        """Writes the transition's record (`write` False: a later transition
        of the same row in this transaction writes both) and its slot change."""
        if write and transition.changed:
            tx.execute(_UPDATE, _params(transition.record))
        if slots and transition.slot_delta:
            admission.adjust(tx, {transition.record.tenant_id: transition.slot_delta})
        done.append(transition)

    def _committed(self, done: Sequence[Transition], slot_waiters: bool = True) -> None:
        """Counts the transitions, and wakes the waiting claims when one of
        them may have made a session claimable: it is owed work and not held,
        or it gave back a slot (`slot_waiters` False: the transaction found
        no other session of the tenant queued, so no claim waits for it).
        A warm turn (a wake, a Finish keeping the session) makes none: the
        claims long-polling meanwhile would each run a claim for nothing."""
        self.metrics.record(done)
        if _may_unblock(done, slot_waiters):
            self._on_change()
