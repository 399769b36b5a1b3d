"""The kernel's loop that fires due schedules (kernel.schedules).

Each tick reads what is due, and for each: appends its input to the ledger
under the firing's request id, wakes the session as the edge would, then
advances the schedule. A crash anywhere in between leaves the schedule due,
and the next tick (here, or in another kernel) appends the same request id:
the ledger answers with the input already committed, so a firing is one
input whatever happens. A firing the ledger refuses (the session is gone)
is logged and the schedule moves on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kernel import schedules
from kernel.lease_rows import Clock, now_ms
from kernel.schedule_store import ScheduleStore
from kernel.schedules import Schedule
from services.common import faults
from services.common.errors import KeelError, ServiceUnavailable

log = logging.getLogger(__name__)

# Due schedules taken per tick.
BATCH = 100

# Commits the firing's input (idempotent by its request id) and wakes its
# session.
Fire = Callable[[Schedule, str], Awaitable[None]]


class Scheduler:
    def __init__(
        self, store: ScheduleStore, fire: Fire, tick_ms: int, clock: Clock = now_ms
    ) -> None:
        self._store = store
        self._fire = fire
        self._tick_s = tick_ms / 1000
        self._clock = clock
        self.fired = 0

    async def tick(self) -> int:
        """Fires what is due now; how many firings were done."""
        now = self._clock()
        done = 0
        for schedule in await asyncio.to_thread(self._store.due, now, BATCH):
            try:
                await self._fire(schedule, schedules.request_id(schedule))
            except ServiceUnavailable:
                raise  # the ledger or kernel is away: the next tick tries again
            except KeelError as refused:
                log.warning("schedule %s could not fire: %s", schedule.schedule_id, refused)
            # Crash tests stop a kernel here: the input is in, the advance not.
            faults.hit("after_schedule_fire")
            following = schedules.after_firing(schedule, now)
            if await asyncio.to_thread(self._store.advance, schedule, following):
                done += 1
        self.fired += done
        return done

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except ServiceUnavailable as away:
                log.info("schedules wait: %s", away)
            except Exception:  # a bug must not end the loop
                log.exception("a schedule tick failed")
            await asyncio.sleep(self._tick_s)
