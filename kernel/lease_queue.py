"""The runnable queue: marking a session as owing work, and claiming it.

An Enqueue (an input accepted) and a Claim (a runtime asking for work) are
the two sides of the queue, and the part of the lease store under load: a
claim reads its candidates unlocked, takes the tenant's slot by a
conditional increment (see `kernel.admission`) and only then locks the
candidate's row with `SKIP LOCKED`, so concurrent claimers take different
sessions and an Enqueue never waits behind admission. Apart from the
holder's calls and expiry because its locking order is its own.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kernel import admission, domain
from kernel.database import Tx
from kernel.domain import Lease, LeaseState, SessionRecord, Transition
from kernel.errors import InvalidArgument, UnknownRuntime
from kernel.handoffs import name_successor
from kernel.lease_rows import SELECT_SESSIONS, LeaseRows, session_record

# How many runnable rows one claim locks and tries (other claimers skip them).
CLAIM_CANDIDATES = 4

_CANDIDATES = (
    f"{SELECT_SESSIONS} WHERE s.queued = 1 AND s.parked = 0 AND s.state <> 'held' "
    "AND s.not_before_ms <= %s "
    "AND NOT EXISTS (SELECT 1 FROM kernel_slots t "
    "WHERE t.tenant_id = s.tenant_id AND t.in_use >= t.max_runs) "
    "ORDER BY s.queued_at_ms, s.session_id LIMIT %s"
)
# One candidate, locked and read afresh once its tenant's slot is taken.
_CANDIDATE = f"{SELECT_SESSIONS} WHERE s.session_id = %s {{skip_locked}}"

_QUEUE_DEPTH = (
    "SELECT COUNT(*), SUM(CASE WHEN EXISTS (SELECT 1 FROM kernel_slots t "
    "WHERE t.tenant_id = s.tenant_id AND t.in_use >= t.max_runs) THEN 1 ELSE 0 END) "
    "FROM kernel_sessions s WHERE s.queued = 1 AND s.parked = 0 AND s.state <> 'held'"
)


@dataclass(frozen=True)
class Claimed:
    lease: Lease
    # The tenant's latest loadout revision (0: none stored, the default
    # applies); None when not asked for, or when the tenant does not exist.
    loadout_revision: int | None = None


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


class LeaseQueue(LeaseRows):
    """Enqueue and Claim, on the lease store's rows."""

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
                record = self._create(tx, session_id, tenant_id)
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
                for record in map(session_record, rows):
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
        record = None if locked is None else session_record(locked)
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
