"""Feeding WatchRevocations streams: revoked keys, backlog then live.

A watcher reads `key_revocations` after the last id it sent, then waits for a
wake-up and reads again. Revocations made through this replica wake it at
once (`notify`, called by RevokeApiKey). Another replica's revocations are
only in the shared table, so while anyone watches, one poll per replica
reads the table's highest id every `poll_s` (≤ 500 ms) and wakes the
watchers when it grew: one cheap query however many edges watch.

Watchers take the current wake-up event *before* reading, so a revocation
committed between "read nothing new" and "wait" still wakes them. Ids become
visible in id order (TenantStore.revoke_api_key serializes revokers), so a
watcher's "after this id" never skips one committed late.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from kernel.tenancy import Revocation, TenantStore
from services.common.errors import KeelError
from services.common.outage_log import OutageLog

log = logging.getLogger(__name__)

POLL_S = 0.5
BATCH = 1000


class RevocationFeed:
    def __init__(self, tenants: TenantStore, poll_s: float = POLL_S) -> None:
        self._tenants = tenants
        self._poll_s = poll_s
        self._event = asyncio.Event()
        self._watchers = 0
        self._poller: asyncio.Task[None] | None = None
        self._highest_seen = 0
        self._closed = False

    def notify(self) -> None:
        """Wakes every watcher (call on the event loop)."""
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def watch(self, after_id: int) -> AsyncIterator[Revocation]:
        """Every revocation with an id above `after_id`, in order, until closed."""
        self._watchers += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(
                self._poll(), name="kernel-revocation-poll"
            )
        try:
            while not self._closed:
                woken = self._event
                batch = await asyncio.to_thread(self._tenants.revocations_after, after_id, BATCH)
                for revocation in batch:
                    yield revocation
                    after_id = revocation.revocation_id
                if len(batch) < BATCH and not self._closed:
                    await woken.wait()
        finally:
            self._watchers -= 1
            if self._watchers == 0 and self._poller is not None:
                self._poller.cancel()
                self._poller = None

    async def _poll(self) -> None:
        outage = OutageLog(log, "kernel database", attempts="polls of key revocations failed")
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                highest = await asyncio.to_thread(self._tenants.last_revocation_id)
            except KeelError as error:
                outage.failed(error)  # said once per outage, not every poll
                continue
            outage.succeeded()
            if highest > self._highest_seen:
                self._highest_seen = highest
                self.notify()

    async def close(self) -> None:
        """Ends every watch (a draining kernel; edges reconnect elsewhere)."""
        self._closed = True
        self.notify()
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
