"""Leases, the runnable queue and admission slots, in the kernel's tables.

Every operation loads the session row under a row lock, lets
`kernel.domain` decide, and writes the row and its tenant's slot counter in
the same transaction. A claim reads its candidates unlocked, takes the
tenant's slot by a conditional increment (see `kernel.admission`) and only
then locks the candidate's row with `SKIP LOCKED`: concurrent claimers (in
one process or in several kernel replicas) take different sessions instead
of waiting on each other, and no session row is held while a claim waits
for its tenant's counter, so an Enqueue never waits behind admission.

Store calls are synchronous (the servicer runs them in threads). The clock
is injected so tests can move time.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, fields
from enum import Enum
from typing import TypeVar

from kernel import admission, domain
from kernel.database import Database, Row, Tx
from kernel.domain import (
    FailureKind,
    FinishResult,
    Lease,
    LeaseInfo,
    LeaseState,
    RetryPolicy,
    SessionRecord,
    Transition,
)
from kernel.errors import InvalidArgument, KernelError, SessionNotFound, UnknownRuntime
from kernel.handoffs import HandoffNote, insert_handoff, name_successor
from kernel.metrics import KernelMetrics

log = logging.getLogger("keel.kernel.store")

# How many runnable rows one claim locks and tries (other claimers skip them).
CLAIM_CANDIDATES = 4
# Leases expired per sweep transaction.
SWEEP_BATCH = 500

Clock = Callable[[], int]
R = TypeVar("R")

_COLUMNS = [f.name for f in fields(SessionRecord)]
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM kernel_sessions s"
_UPDATE = (
    f"UPDATE kernel_sessions SET {', '.join(f'{c} = %s' for c in _COLUMNS[1:])} "
    "WHERE session_id = %s"
)
_CANDIDATES = (
    f"{_SELECT} WHERE s.queued = 1 AND s.parked = 0 AND s.state <> 'held' "
    "AND s.not_before_ms <= %s "
    "AND NOT EXISTS (SELECT 1 FROM kernel_slots t "
    "WHERE t.tenant_id = s.tenant_id AND t.in_use >= t.max_runs) "
    "ORDER BY s.queued_at_ms, s.session_id LIMIT %s"
)
# One candidate, locked and read afresh once its tenant's slot is taken.
_CANDIDATE = f"{_SELECT} WHERE s.session_id = %s {{skip_locked}}"

_QUEUE_DEPTH = (
    "SELECT COUNT(*), SUM(CASE WHEN EXISTS (SELECT 1 FROM kernel_slots t "
    "WHERE t.tenant_id = s.tenant_id AND t.in_use >= t.max_runs) THEN 1 ELSE 0 END) "
    "FROM kernel_sessions s WHERE s.queued = 1 AND s.parked = 0 AND s.state <> 'held'"
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _record(row: Row) -> SessionRecord:
    values = dict(zip(_COLUMNS, row, strict=True))
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


@dataclass(frozen=True)
class Claimed:
    lease: Lease
    # The tenant's latest loadout revision (0: none stored, the default
    # applies); None when not asked for, or when the tenant does not exist.
    loadout_revision: int | None = None


def _draining(tx: Tx, runtime_id: str) -> bool:
    row = tx.one("SELECT drain_mode FROM runtime_instances WHERE runtime_id = %s", (runtime_id,))
    return row is not None and row[0] != domain.DrainMode.NONE


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


def _latest_revision(tx: Tx, tenant_id: str) -> int | None:
    # One round trip inside the claim's transaction; the primary key
    # (tenant_id, revision) answers the MAX from its index.
    row = tx.one(
        "SELECT (SELECT MAX(l.revision) FROM loadouts l WHERE l.tenant_id = t.tenant_id) "
        "FROM tenants t WHERE t.tenant_id = %s",
        (tenant_id,),
    )
    if row is None:
        return None
    return int(row[0] or 0)


class _Missed(Enum):
    """Why a claim candidate was not claimed."""

    # Its tenant has no free run slot.
    FULL = "full"
    # Its row is locked, or no longer claimable: another claimer was first.
    TAKEN = "taken"


@dataclass
class _Refused:
    """A domain refusal, returned out of the transaction so what was already
    decided in it (e.g. the lease's TTL expiry) still commits."""

    error: KernelError


class LeaseStore:
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

    # -- rows --

    def _load(self, tx: Tx, session_id: str) -> SessionRecord | None:
        row = tx.one(f"{_SELECT} WHERE s.session_id = %s {{lock}}", (session_id,))
        return None if row is None else _record(row)

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

    # -- the queue --

    def enqueue(
        self,
        session_id: str,
        tenant_id: str,
        input_seq: int,
        unpark: bool,
        can_wake: Callable[[str], bool] | None = None,
    ) -> Claimed | None:
        """Marks the session as owing work. A session in its sticky window
        whose holder `can_wake` (a LeaseStream of it is here) and whose tenant
        has a free slot is held again by that holder, same epoch: returned, so
        the caller sends it the wake. Otherwise the window ends and the
        session waits for a claim like any other."""
        done: list[Transition] = []

        def work(tx: Tx) -> Claimed | None:
            done.clear()  # a transaction redone after a lost race starts over
            now = self._clock()
            record = self._load(tx, session_id)
            if record is None:
                tx.execute(
                    "INSERT INTO kernel_sessions (session_id, tenant_id) VALUES (%s, %s) "
                    "ON CONFLICT (session_id) DO NOTHING",
                    (session_id, tenant_id),
                )
                record = self._load(tx, session_id)
                assert record is not None
                # A tenant's first session: its slot counter. (Later ones
                # find it; a missing one is made by admission.take.)
                admission.ensure_counter(tx, tenant_id)
            if record.tenant_id != tenant_id:
                raise InvalidArgument(
                    f"session {session_id!r} belongs to another tenant", field="tenant_id"
                )
            queued = domain.enqueue(record, input_seq, unpark, now)
            record = queued.record
            if record.state is not LeaseState.STICKY:
                self._apply(tx, queued, done)
                return None
            # The window's outcome below writes the row once, queue fields too.
            self._apply(tx, queued, done, write=False)
            wakeable = (
                record.sticky(now)
                and can_wake is not None
                and can_wake(record.runtime_id)
                # A wake skips the queue: only into a slot nobody waits for.
                and admission.spare(tx, session_id, now, tenant_id) >= 1
            )
            # The slot is taken last: a full tenant ends the window instead.
            if wakeable and admission.take(tx, tenant_id):
                woken = domain.wake(record, now, self.lease_ms)
                self._apply(tx, woken, done, slots=False)
                return Claimed(woken.record.lease(), _latest_revision(tx, tenant_id))
            self._apply(tx, domain.end_sticky(record, now), done)
            return None

        woken = self._db.run(work)
        self._committed(done)
        return woken

    def claim(self, runtime_id: str) -> Lease | None:
        """The oldest claimable session whose tenant has a free slot, or None."""
        claimed = self.claim_with_loadout(runtime_id, with_loadout=False)
        return None if claimed is None else claimed.lease

    def claim_with_loadout(self, runtime_id: str, with_loadout: bool = True) -> Claimed | None:
        """`claim`, and (`with_loadout`) the claimed tenant's latest loadout
        revision, read in the same transaction: the claimer learns which
        loadout to run without asking for it on its own."""
        done: list[Transition] = []

        passed_over: Counter[str] = Counter()

        def work(tx: Tx) -> Claimed | None:
            done.clear()
            passed_over.clear()
            now = self._clock()
            runtime = tx.one(
                "SELECT drain_mode FROM runtime_instances WHERE runtime_id = %s", (runtime_id,)
            )
            if runtime is None:
                raise UnknownRuntime(f"runtime {runtime_id!r} is not registered")
            if runtime[0] != domain.DrainMode.NONE:
                return None
            # The candidates are read without a lock; each one's tenant slot is
            # taken before its row is locked (with SKIP LOCKED, never waiting),
            # so no session row is held while its claim waits on the tenant's
            # counter: an Enqueue (an input's acceptance) never waits behind
            # admission. A tenant found full is not tried again in this claim.
            full: set[str] = set()
            for _ in range(3):
                rows = tx.rows(_CANDIDATES, (now, CLAIM_CANDIDATES))
                if not rows:
                    return None
                for record in map(_record, rows):
                    if record.tenant_id in full:
                        continue
                    claimed = self._try_candidate(tx, record, runtime_id, now, done, with_loadout)
                    if claimed is _Missed.FULL:
                        full.add(record.tenant_id)
                        passed_over[record.tenant_id] += 1
                    elif isinstance(claimed, Claimed):
                        return claimed
            return None

        claimed = self._db.run(work)
        self.metrics.record(done)
        self.metrics.admission_rejected(sum(passed_over.values()))
        return claimed

    def _try_candidate(
        self,
        tx: Tx,
        candidate: SessionRecord,
        runtime_id: str,
        now: int,
        done: list[Transition],
        with_loadout: bool,
    ) -> Claimed | _Missed:
        """Claims one candidate: its tenant's slot first, then its row."""
        tenant_id = candidate.tenant_id
        # Undone (with the counter's lock) if the row turns out to be taken,
        # so a claim holds at most one tenant's counter at a time.
        wrote = tx.wrote
        tx.execute("SAVEPOINT claim_candidate")
        if not admission.take(tx, tenant_id):
            tx.execute("ROLLBACK TO SAVEPOINT claim_candidate")
            tx.wrote = wrote
            return _Missed.FULL
        locked = tx.one(_CANDIDATE, (candidate.session_id,))
        record = None if locked is None else _record(locked)
        if record is None or record.tenant_id != tenant_id or not record.claimable(now):
            tx.execute("ROLLBACK TO SAVEPOINT claim_candidate")
            tx.wrote = wrote
            return _Missed.TAKEN
        tx.execute("RELEASE SAVEPOINT claim_candidate")
        transition = domain.claim(record, runtime_id, uuid.uuid4().hex, now, self.lease_ms)
        # The slot taken above is the new lease's; a lease still marked held
        # (past its TTL) passes its own slot on, so the one taken goes back.
        self._apply(tx, transition, done, slots=False)
        if transition.slot_delta == 0:
            admission.adjust(tx, {tenant_id: -1})
        if record.state in (LeaseState.RELEASED, LeaseState.EXPIRED):
            # Given back (a handoff?) or given up: this is the successor.
            name_successor(tx, record.session_id, runtime_id)
        lease = transition.record.lease(transition.reclaimed)
        revision = _latest_revision(tx, tenant_id) if with_loadout else None
        return Claimed(lease, revision)

    def queue_depth(self) -> tuple[int, int]:
        """(runnable sessions nobody holds, those of them whose tenant's run
        slots are all taken)."""
        row = self._db.run(lambda tx: tx.one(_QUEUE_DEPTH), write=False)
        return (0, 0) if row is None else (int(row[0] or 0), int(row[1] or 0))

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
                raise SessionNotFound(f"the kernel has no session {session_id!r}")
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

    # -- expiry --

    def sweep(self) -> int:
        """Expires leases past their TTL (returning their slots); how many."""
        done: list[Transition] = []

        def work(tx: Tx) -> None:
            done.clear()
            now = self._clock()
            rows = tx.rows(
                f"{_SELECT} WHERE s.state = 'held' AND s.expires_at_ms <= %s "
                "ORDER BY s.session_id LIMIT %s {skip_locked}",
                (now, SWEEP_BATCH),
            )
            self._apply_all(tx, [domain.expire_due(_record(r), now) for r in rows], done)

        self._db.run(work)
        self._committed(done)
        return len(done)

    def expire_runtime(
        self, runtime_id: str, dead: Callable[[Tx, int], bool] | None = None
    ) -> list[str]:
        """Fast takeover: ends every live lease of a runtime whose connection
        died, now rather than at TTL. Returns the sessions it freed.

        With `dead`, only if `dead(tx, now)` confirms the death in the same
        transaction (kernel.liveness: a heartbeat still stale under lock)."""
        done: list[Transition] = []

        def work(tx: Tx) -> None:
            done.clear()
            now = self._clock()
            if dead is not None and not dead(tx, now):
                return
            rows = tx.rows(
                f"{_SELECT} WHERE s.runtime_id = %s AND s.state = 'held' "
                "ORDER BY s.session_id {lock}",
                (runtime_id,),
            )
            transitions = [domain.expire_for_disconnect(_record(r), now) for r in rows]
            self._apply_all(tx, transitions, done)

        self._db.run(work)
        self._committed(done)
        return [t.record.session_id for t in done]

    def end_sticky(self, runtime_id: str = "", tenant_id: str = "") -> list[str]:
        """Ends the sticky windows of a runtime (it drains) or of a tenant
        (its loadout changed): their next inputs are claimed, by anyone."""
        done: list[Transition] = []
        column, value = ("runtime_id", runtime_id) if runtime_id else ("tenant_id", tenant_id)

        def work(tx: Tx) -> None:
            done.clear()
            now = self._clock()
            rows = tx.rows(
                f"{_SELECT} WHERE s.{column} = %s AND s.state = 'sticky' "
                "ORDER BY s.session_id {lock}",
                (value,),
            )
            self._apply_all(tx, [domain.end_sticky(_record(r), now) for r in rows], done)

        self._db.run(work)
        self._committed(done)
        return [t.record.session_id for t in done]

    def _apply_all(self, tx: Tx, transitions: Sequence[Transition], done: list[Transition]) -> None:
        """Writes rows, then the slot counters of all their tenants at once."""
        returned: Counter[str] = Counter()
        for transition in transitions:
            if not transition.changed:
                continue
            self._apply(tx, transition, done, slots=False)
            returned[transition.record.tenant_id] += transition.slot_delta
        admission.adjust(tx, returned)

    def reconcile_slots(self) -> dict[str, tuple[int, int]]:
        """Recounts every tenant's slots from the live leases (start-up).

        Counters change in the same transaction as the lease rows, so they
        should already agree; a difference is logged and repaired, never
        left to leak. Returns {tenant: (counted before, actual)} of repairs.
        """
        repairs = self._db.run(admission.recount)
        for tenant_id, (before, actual) in repairs.items():
            log.warning("admission slots of %s recounted: %d -> %d", tenant_id, before, actual)
        return repairs

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
                tx.execute(
                    "INSERT INTO kernel_sessions (session_id, tenant_id) VALUES (%s, %s) "
                    "ON CONFLICT (session_id) DO NOTHING",
                    (session_id, tenant_id),
                )
                record = self._load(tx, session_id)
                assert record is not None
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
            lambda tx: tx.one(f"{_SELECT} WHERE s.session_id = %s", (session_id,)), write=False
        )
        return None if row is None else _record(row)

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
