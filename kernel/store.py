"""Leases, the runnable queue and admission slots, in the kernel's tables.

Every operation loads the session row under a row lock, lets
`kernel.domain` decide, and writes the row and its tenant's slot counter in
the same transaction. A claim reads its candidates unlocked, takes the
tenant's slot by a conditional increment (see `kernel.admission`) and only
then locks the candidate's row with `SKIP LOCKED`: concurrent claimers (in
one process or in several kernel replicas) take different sessions instead
of waiting on each other, and no session row is held while a claim waits
for its tenant's counter, so an Enqueue never waits behind admission.

`LeaseStore` gathers the operations; this module holds the holder's calls
(Renew, Release, Finish), the reconciliation with the ledger and the reads.
The row writes are in `kernel.lease_rows`, the queue (Enqueue, Claim) in
`kernel.lease_queue`, and the bulk ends of leases (sweeps, takeovers) in
`kernel.lease_ends`.

Store calls are synchronous (the servicer runs them in threads). The clock
is injected so tests can move time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kernel import admission, domain
from kernel.database import Tx
from kernel.domain import FailureKind, FinishResult, LeaseInfo, SessionRecord, Transition
from kernel.errors import KernelError, UnknownSession
from kernel.handoffs import HandoffNote, insert_handoff
from kernel.lease_ends import SWEEP_BATCH, LeaseEnds
from kernel.lease_queue import CLAIM_CANDIDATES, Claimed, LeaseQueue
from kernel.lease_rows import SELECT_SESSIONS, Clock, now_ms, session_record

# What callers have always imported from here.
__all__ = ["CLAIM_CANDIDATES", "SWEEP_BATCH", "Claimed", "Clock", "LeaseStore", "now_ms"]

R = TypeVar("R")


def _draining(tx: Tx, runtime_id: str) -> bool:
    row = tx.one("SELECT drain_mode FROM runtime_instances WHERE runtime_id = %s", (runtime_id,))
    return row is not None and row[0] != domain.DrainMode.NONE


@dataclass
class _Refused:
    """A domain refusal, returned out of the transaction so what was already
    decided in it (e.g. the lease's TTL expiry) still commits."""

    error: KernelError


class LeaseStore(LeaseQueue, LeaseEnds):
    # -- the holder's calls --

    def _on_lease(
        self,
        session_id: str,
        decide: Callable[[SessionRecord, int], tuple[Transition, R]],
        also: Callable[[Tx, Transition, int], None] | None = None,
        before: Callable[[Tx], None] | None = None,
        slot_waiters: Callable[[], bool] = lambda: True,
    ) -> R:
        """Loads the session, expires its lease if past TTL, then `decide`s;
        `also` writes more in the same transaction once the decision holds;
        `slot_waiters` says afterwards what `before` found (`_committed`)."""
        done: list[Transition] = []

        def work(tx: Tx) -> R | _Refused:
            done.clear()
            if before is not None:
                before(tx)
            now = self._clock()
            record = self._load(tx, session_id)
            if record is None:
                raise UnknownSession(f"the kernel has no session {session_id!r}")
            due = domain.expire_due(record, now)
            self._apply(tx, due, done)
            try:
                transition, result = decide(due.record, now)
            except KernelError as error:
                return _Refused(error)
            self._apply(tx, transition, done)
            if also is not None:
                also(tx, transition, now)
            return result

        outcome = self._db.run(work)
        self._committed(done, slot_waiters())
        if isinstance(outcome, _Refused):
            raise outcome.error
        return outcome

    def renew(self, session_id: str, epoch: int, runtime_id: str) -> int:
        def decide(record: SessionRecord, now: int) -> tuple[Transition, int]:
            transition = domain.renew(record, epoch, runtime_id, now, self.lease_ms)
            return transition, transition.record.expires_at_ms

        return self._on_lease(session_id, decide)

    def release(
        self, session_id: str, epoch: int, runtime_id: str, handoff: HandoffNote | None = None
    ) -> None:
        """Hands the lease back; with `handoff`, a handoff row is written in
        the same transaction (once: a retried release writes none)."""

        def decide(record: SessionRecord, now: int) -> tuple[Transition, None]:
            return domain.release(record, epoch, runtime_id, now), None

        def audit(tx: Tx, transition: Transition, now: int) -> None:
            if handoff is not None and transition.changed:
                insert_handoff(tx, runtime_id, "", handoff, session_id, epoch, now)

        self._on_lease(session_id, decide, audit)

    def finish(
        self,
        session_id: str,
        epoch: int,
        runtime_id: str,
        read_through: int,
        failed: bool = False,
        error: str = "",
        kind: FailureKind = FailureKind.RETRYABLE,
        retry_after_ms: int = 0,
        sticky_ms: int = 0,
    ) -> FinishResult:
        """Settles an attempt; `sticky_ms` asks to keep the session for that
        long (not granted to a draining runtime)."""
        sticky = [sticky_ms]
        # Holding the lease on for an input that came first skips the queue.
        may_continue = [True]
        # Whether another session of the tenant is queued (unknown: assume so).
        others_queued = [True]

        def decide(record: SessionRecord, now: int) -> tuple[Transition, FinishResult]:
            return domain.finish(
                record,
                epoch,
                runtime_id,
                read_through,
                failed,
                error,
                now,
                self.policy,
                kind=kind,
                retry_after_ms=retry_after_ms,
                sticky_ms=sticky[0],
                ttl_ms=self.lease_ms,
                may_continue=may_continue[0],
            )

        def before(tx: Tx) -> None:
            if sticky_ms > 0 and _draining(tx, runtime_id):
                sticky[0] = 0
            if sticky[0] > 0:
                # Holding on keeps the slot: only while nobody waits for one.
                free, waiting = admission.free_and_waiting(tx, session_id, self._clock())
                may_continue[0] = free >= waiting
                others_queued[0] = waiting > 0

        return self._on_lease(
            session_id, decide, before=before, slot_waiters=lambda: others_queued[0]
        )

    # -- reconciliation with the ledger --

    def enqueue_if_stranded(self, session_id: str, tenant_id: str) -> bool:
        """Enqueues an owing session the kernel does not know is owing (neither
        queued nor leased): a lost wake-up. True if it was stranded."""
        done: list[Transition] = []

        def work(tx: Tx) -> bool:
            done.clear()
            now = self._clock()
            record = self._load(tx, session_id)
            if record is not None and (record.queued or record.live(now)):
                return False
            if record is None:
                record = self._create(tx, session_id, tenant_id)
            # input_seq 0: the max announced so far stays; the ledger's head
            # may be an answer, not an input, and must not fake newer work.
            self._apply(tx, domain.enqueue(record, 0, False, now), done)
            admission.ensure_counter(tx, record.tenant_id)
            return True

        stranded = self._db.run(work)
        self._committed(done)
        return stranded

    # -- reads --

    def get_lease(self, session_id: str) -> LeaseInfo:
        now = self._clock()
        record = self.record(session_id)
        if record is None:
            return LeaseInfo(lease=None, queued=False, parked=False)
        return record.info(now)

    def record(self, session_id: str) -> SessionRecord | None:
        row = self._db.run(
            lambda tx: tx.one(f"{SELECT_SESSIONS} WHERE s.session_id = %s", (session_id,)),
            write=False,
        )
        return None if row is None else session_record(row)

    def held_by(self) -> dict[str, list[tuple[str, str]]]:
        """Live leases by runtime: {runtime_id: [(session id, tenant id)]}."""
        now = self._clock()
        rows = self._db.run(
            lambda tx: tx.rows(
                "SELECT runtime_id, session_id, tenant_id FROM kernel_sessions "
                "WHERE state = 'held' AND expires_at_ms > %s ORDER BY session_id",
                (now,),
            ),
            write=False,
        )
        out: dict[str, list[tuple[str, str]]] = {}
        for runtime_id, session_id, tenant_id in rows:
            out.setdefault(runtime_id, []).append((session_id, tenant_id))
        return out

    def slots(self, tenant_id: str) -> tuple[int, int]:
        """(in use, max) of a tenant's admission slots."""
        return self._db.run(lambda tx: admission.usage(tx, tenant_id), write=False)

    def held_count(self, tenant_id: str) -> int:
        row = self._db.run(
            lambda tx: tx.one(
                "SELECT COUNT(*) FROM kernel_sessions WHERE tenant_id = %s AND state = 'held'",
                (tenant_id,),
            ),
            write=False,
        )
        return 0 if row is None else int(row[0])
