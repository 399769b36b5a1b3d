"""Scheduled inputs in the kernel's tables (`kernel_schedules`).

Firing is decided with compare-and-set on `next_fire_ms`: whoever fires a
due time (this kernel again after a crash, or another replica at the same
moment) appends the same input (its request id is the schedule and that
time, kernel.schedules), and only one advance of the schedule lands.
"""

from __future__ import annotations

import uuid

from kernel import schedules
from kernel.database import Database, Row, Tx
from kernel.errors import InvalidArgument
from kernel.lease_rows import Clock, now_ms
from kernel.schedules import Schedule

_COLUMNS = (
    "schedule_id, tenant_id, session_id, text, cron, timezone, at_ms, next_fire_ms, created_at_ms"
)
# A session's schedules at most: each is a row a tick may read.
MAX_PER_SESSION = 100


def _schedule(row: Row) -> Schedule:
    return Schedule(
        str(row[0]),
        str(row[1]),
        str(row[2]),
        str(row[3]),
        str(row[4]),
        str(row[5]),
        int(row[6]),
        int(row[7]),
        int(row[8]),
    )


class ScheduleStore:
    def __init__(self, database: Database, clock: Clock = now_ms) -> None:
        self._db = database
        self._clock = clock

    def create(
        self, tenant_id: str, session_id: str, text: str, cron: str, timezone: str, at_ms: int
    ) -> Schedule:
        if not text or len(text) > schedules.MAX_TEXT_CHARS:
            raise InvalidArgument("a schedule's text is 1 to 262144 characters", field="text")
        now = self._clock()
        schedules.zone(timezone)
        first = schedules.first_fire_ms(cron, timezone, at_ms, now)
        schedule = Schedule(
            uuid.uuid4().hex, tenant_id, session_id, text, cron, timezone, at_ms, first, now
        )

        def work(tx: Tx) -> None:
            count = tx.one(
                "SELECT COUNT(*) FROM kernel_schedules WHERE session_id = %s", (session_id,)
            )
            if count is not None and int(count[0]) >= MAX_PER_SESSION:
                raise InvalidArgument(
                    f"a session has at most {MAX_PER_SESSION} schedules", field="session_id"
                )
            tx.execute(
                f"INSERT INTO kernel_schedules ({_COLUMNS}) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    schedule.schedule_id,
                    tenant_id,
                    session_id,
                    text,
                    cron,
                    timezone,
                    at_ms,
                    first,
                    now,
                ),
            )

        self._db.run(work)
        return schedule

    def of_session(self, session_id: str) -> list[Schedule]:
        rows = self._db.run(
            lambda tx: tx.rows(
                f"SELECT {_COLUMNS} FROM kernel_schedules WHERE session_id = %s "
                "ORDER BY created_at_ms, schedule_id",
                (session_id,),
            ),
            write=False,
        )
        return [_schedule(row) for row in rows]

    def delete(self, session_id: str, schedule_id: str) -> bool:
        deleted = self._db.run(
            lambda tx: tx.execute(
                "DELETE FROM kernel_schedules WHERE session_id = %s AND schedule_id = %s",
                (session_id, schedule_id),
            )
        )
        return deleted > 0

    def due(self, now: int, limit: int) -> list[Schedule]:
        rows = self._db.run(
            lambda tx: tx.rows(
                f"SELECT {_COLUMNS} FROM kernel_schedules WHERE next_fire_ms <= %s "
                "ORDER BY next_fire_ms LIMIT %s",
                (now, limit),
            ),
            write=False,
        )
        return [_schedule(row) for row in rows]

    def advance(self, fired: Schedule, next_fire_ms: int | None) -> bool:
        """Moves the schedule past the time it just fired (`next_fire_ms`
        None: a one-off is over), if nobody did first."""
        if next_fire_ms is None:
            query = "DELETE FROM kernel_schedules WHERE schedule_id = %s AND next_fire_ms = %s"
            params: tuple[object, ...] = (fired.schedule_id, fired.next_fire_ms)
        else:
            query = (
                "UPDATE kernel_schedules SET next_fire_ms = %s "
                "WHERE schedule_id = %s AND next_fire_ms = %s"
            )
            params = (next_fire_ms, fired.schedule_id, fired.next_fire_ms)
        return self._db.run(lambda tx: tx.execute(query, params)) > 0
