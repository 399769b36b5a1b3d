"""Reconciliation with the ledger: a lost wake-up never strands a session.

Enqueue is a wake-up sent after an input is committed; if it is lost (the
caller crashed between the commit and the call, the kernel was down), the
ledger still says the session owes work. Periodically — and once at
start-up — the kernel pages through the ledger's sessions and enqueues
every owing one that it has neither queued nor leased.

The pages are read without `owing_only`: that filter is applied by the
ledger after it cuts a page of ids, so a short or empty page would not mean
the end of the list. Each summary carries `owes_work`, so filtering here is
as cheap and always reaches the last page.
"""

from __future__ import annotations

import asyncio
import logging

from kernel.store import LeaseStore
from services.common.config import Settings
from services.common.errors import KeelError
from services.ledger import LedgerClient

log = logging.getLogger("keel.kernel.reconcile")

PAGE = 500


class Reconciler:
    def __init__(
        self, leases: LeaseStore, ledger_target: str, settings: Settings, interval_ms: int
    ) -> None:
        self._leases = leases
        self._ledger = LedgerClient(ledger_target, settings)
        self._interval_s = interval_ms / 1000
        self.passes = 0
        self.enqueued = 0

    async def reconcile_once(self) -> int:
        """One pass over the ledger; how many stranded sessions it enqueued."""
        after = ""
        found = 0
        while True:
            page = await self._ledger.list_sessions(
                after_session_id=after, limit=PAGE, owing_only=True
            )
            for summary in page.sessions:
                stranded = await asyncio.to_thread(
                    self._leases.enqueue_if_stranded, summary.session_id, summary.tenant_id
                )
                if stranded:
                    found += 1
                    log.info(
                        "session %s owed work but was not queued; enqueued", summary.session_id
                    )
            if not page.next_after:
                break
            after = page.next_after
        self.passes += 1
        self.enqueued += found
        return found

    async def run(self) -> None:
        while True:
            try:
                await self.reconcile_once()
            except KeelError as error:
                # The ledger may be starting or restarting; the next pass catches up.
                log.warning("reconciliation with the ledger failed: %s", error)
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        await self._ledger.close()
