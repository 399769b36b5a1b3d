"""Reconciliation with the ledger: a lost wake-up never strands a session.

Enqueue is a wake-up sent after an input is committed; if it is lost (the
caller crashed between the commit and the call, the kernel was down), the
ledger still says the session owes work. Periodically — and once at
start-up — the kernel pages through the ledger's sessions and enqueues
every owing one that it has neither queued nor leased.

The pages are read with `owing_only`, which the ledger applies after it
cuts a page of ids: a short or empty page is not the end of the list, so a
pass follows the page's cursor, never its length, to the last page.

Most sessions found stranded are not stuck: a page is read before each
session is looked up in the kernel, and an answer committed in between (its
lease released a moment later) looks exactly like a lost wake-up; so does an
input whose wake-up is still on its way. Each is enqueued at once (a
spurious wake-up costs an attempt that finds nothing to do) but warned about
only when the ledger still shows the head the page showed — nothing landed
since — and that head is older than the grace period: work really stuck.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from keel.ledger.v1 import ledger_pb2 as pb
from kernel.store import LeaseStore
from services.common.config import Settings
from services.common.errors import KeelError
from services.common.outage_log import OutageLog
from services.ledger import LedgerClient
from services.ledger.client import SessionPage

log = logging.getLogger(__name__)

PAGE = 500


def wall_clock_ms() -> float:
    """Compared with the ledger's commit timestamps: the hosts' clocks are
    assumed to agree to well within the grace period."""
    return time.time() * 1000


class Reconciler:
    def __init__(
        self,
        leases: LeaseStore,
        ledger_target: str,
        settings: Settings,
        interval_ms: int,
        grace_ms: int,
        clock: Callable[[], float] = wall_clock_ms,
    ) -> None:
        self._leases = leases
        self._ledger = LedgerClient(ledger_target, settings)
        self._interval_s = interval_ms / 1000
        self._grace_ms = grace_ms
        self._clock = clock
        self.passes = 0
        self.enqueued = 0
        # Sessions warned about as stuck, over the kernel's lifetime.
        self.stuck = 0

    async def reconcile_once(self) -> int:
        """One pass over the ledger; how many stranded sessions it enqueued."""
        after = ""
        found = 0
        while True:
            page = await self._owing_page(after)
            for summary in page.sessions:
                stranded = await asyncio.to_thread(
                    self._leases.enqueue_if_stranded, summary.session_id, summary.tenant_id
                )
                if stranded:
                    found += 1
                    # Counted at once: the session may be claimed (and an
                    # observer look) while the report below reads the ledger.
                    self.enqueued += 1
                    await self._report(summary)
            if not page.next_after:
                break
            after = page.next_after
        self.passes += 1
        return found

    async def _owing_page(self, after: str) -> SessionPage:
        return await self._ledger.list_sessions(after_session_id=after, limit=PAGE, owing_only=True)

    async def _report(self, summary: pb.SessionSummary) -> None:
        """Warns about a session just enqueued only if it was really stuck."""
        session_id, listed_head = summary.session_id, summary.head_seq
        try:
            facts, head = await self._ledger.read(session_id, after_seq=listed_head - 1, limit=1)
        except KeelError as error:
            # It is enqueued either way; only the verdict is lost.
            log.debug("session %s: enqueued; could not re-read it: %s", session_id, error)
            return
        if head != listed_head or not facts:
            log.debug("session %s: enqueued; seq %d landed since the listing", session_id, head)
            return
        owed_for_ms = self._clock() - facts[0].timestamp_ms
        if owed_for_ms < self._grace_ms:
            log.debug("session %s owed work, not yet queued; enqueued", session_id)
            return
        self.stuck += 1
        log.warning(
            "session %s owed work for %d ms (nothing committed since seq %d) but was neither "
            "queued nor leased; enqueued",
            session_id,
            owed_for_ms,
            head,
        )

    async def run(self) -> None:
        outage = OutageLog(log, "ledger", attempts="reconciliations failed")
        while True:
            try:
                await self.reconcile_once()
            except KeelError as error:
                # The ledger may be starting or restarting; the next pass
                # catches up. Said once per outage, not every pass.
                outage.failed(error)
            else:
                outage.succeeded()
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        await self._ledger.close()
