"""Requests the edge refuses because a Keel service behind it is away.

While PostgreSQL, the ledger or the kernel is away, every request that
needs it is refused with 503 (UNAVAILABLE over gRPC): dozens a second under
load. Each is counted (`keel_edge_requests_total{status="503"}`, and the
edge's own `/metrics`), and the log says it once (services.common.outage_log):
when refusals begin (with the first one's reason), every 30 s while they go
on, and once the services answer again, with how many were refused.

Whether the services answer again is asked of them, not guessed from
traffic (a route that needs only the ledger may succeed while the kernel is
away): while refusing, a watch asks each edge's probe (`watch_with`: the
calls /readyz makes) every `PROBE_EVERY_S` until one answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from services.common.outage_log import OutageLog

log = logging.getLogger(__name__)

# How often the services are asked whether they answer again.
PROBE_EVERY_S = 1.0

Probe = Callable[[], Awaitable[bool]]


class RefusalLog:
    """Refusals of one process's edges, said once per outage."""

    def __init__(self, probe_every_s: float = PROBE_EVERY_S) -> None:
        self.outage = self._new_outage()
        self._probe_every_s = probe_every_s
        self._probes: list[Probe] = []
        self._watch: asyncio.Task[None] | None = None

    def watch_with(self, probe: Probe) -> Callable[[], None]:
        """Adds an edge's probe (True: its services answer); returns what
        removes it (the edge stops)."""
        self._probes.append(probe)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._probes.remove(probe)
            if not self._probes:
                # No edge left to ask: the next edge's refusals are its own story.
                self.outage = self._new_outage()

        return remove

    @staticmethod
    def _new_outage() -> OutageLog:
        return OutageLog(log, "a Keel service behind this edge", attempts="requests refused (503)")

    def refused(self, what: str) -> None:
        """A request was refused with 503 because of `what` (said only for
        the outage's first refusal)."""
        self.outage.failed(what)
        if self._probes and (self._watch is None or self._watch.done()):
            self._watch = asyncio.get_running_loop().create_task(
                self._until_answered(), name="edge-refusals-watch"
            )

    async def _until_answered(self) -> None:
        # Ends with the outage, or once no edge is left to ask.
        while self.outage.away and self._probes:
            await asyncio.sleep(self._probe_every_s)
            for probe in list(self._probes):
                try:
                    answered = await probe()
                except Exception:  # a stopped edge's probe: another may answer
                    log.debug("refusal probe failed", exc_info=True)
                    continue
                if answered:
                    self.outage.succeeded()
                    return


# The process's edges share one: in production one edge per process.
REFUSALS = RefusalLog()
