"""How leases end in bulk, without their holder: TTL sweeps, a dead runtime's
takeover, the end of sticky windows, and the slot recount at start-up.

These operations touch many rows of many tenants in one transaction, so
they write the rows first and then every tenant's slot counter at once
(`_apply_all`); the single-row operations of the queue and of the holder
do not. `kernel.expiry` decides when they run; this is what they write.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

from kernel import admission, domain
from kernel.database import Tx
from kernel.domain import Transition
from kernel.lease_rows import SELECT_SESSIONS, LeaseRows, session_record

# The store's logger, as before these operations had a module of their own.
log = logging.getLogger(__name__)

# Leases expired per sweep transaction.
SWEEP_BATCH = 500


class LeaseEnds(LeaseRows):
    """Sweeps, takeovers, sticky-window ends and the slot recount."""

    def sweep(self) -> int:
        """Expires leases past their TTL (returning their slots); how many."""
        done: list[Transition] = []

        def work(tx: Tx) -> None:
            done.clear()
            now = self._clock()
            rows = tx.rows(
                f"{SELECT_SESSIONS} WHERE s.state = 'held' AND s.expires_at_ms <= %s "
                "ORDER BY s.session_id LIMIT %s {skip_locked}",
                (now, SWEEP_BATCH),
            )
            self._apply_all(tx, [domain.expire_due(session_record(r), now) for r in rows], done)

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
                f"{SELECT_SESSIONS} WHERE s.runtime_id = %s AND s.state = 'held' "
                "ORDER BY s.session_id {lock}",
                (runtime_id,),
            )
            transitions = [domain.expire_for_disconnect(session_record(r), now) for r in rows]
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
                f"{SELECT_SESSIONS} WHERE s.{column} = %s AND s.state = 'sticky' "
                "ORDER BY s.session_id {lock}",
                (value,),
            )
            self._apply_all(tx, [domain.end_sticky(session_record(r), now) for r in rows], done)

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
