"""Scheduled inputs, as values and pure rules (no I/O).

A schedule belongs to one session and fires an input with its text either
once (`at_ms`) or on a cron expression read in an IANA time zone. Each
firing is identified by the schedule and the time it was due, and that is
the input's request id: the ledger commits one input per request id, so a
firing retried after a crash, or tried by two kernels at once, is one input.

Missed firings (the kernel was down, or the database) fire once, late, and
the schedule goes on from its next time after now: an outage of an hour
under a minutely cron is one input, not sixty.
"""

from __future__ import annotations

import datetime as dt
import zoneinfo
from dataclasses import dataclass

from croniter import CroniterBadCronError, croniter

from kernel.errors import InvalidArgument

MAX_TEXT_CHARS = 256 * 1024


@dataclass(frozen=True)
class Schedule:
    schedule_id: str
    tenant_id: str
    # The ledger's id of the session its inputs go to.
    session_id: str
    text: str
    # Recurring: a 5-field cron expression and the zone it is read in.
    cron: str
    timezone: str
    # Once: the time to fire (0 for a recurring schedule).
    at_ms: int
    # When it is next due.
    next_fire_ms: int
    created_at_ms: int

    @property
    def once(self) -> bool:
        return not self.cron


def zone(name: str) -> zoneinfo.ZoneInfo:
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise InvalidArgument(f"unknown time zone {name[:64]!r}", field="timezone") from None


def next_cron_ms(cron: str, timezone: str, after_ms: int) -> int:
    """The first time strictly after `after_ms` that `cron` names, in `timezone`."""
    start = dt.datetime.fromtimestamp(after_ms / 1000, tz=zone(timezone))
    try:
        following = croniter(cron, start).get_next(dt.datetime)
    except (CroniterBadCronError, ValueError, KeyError) as bad:
        raise InvalidArgument(
            f"not a cron expression: {cron[:64]!r} ({bad})", field="cron"
        ) from None
    return int(following.timestamp() * 1000)


def first_fire_ms(cron: str, timezone: str, at_ms: int, now_ms: int) -> int:
    """When a new schedule is first due: `at_ms` (once), or the cron's next time."""
    if bool(cron) == bool(at_ms):
        raise InvalidArgument(
            "a schedule has either a cron expression or a time `at`", field="cron"
        )
    if cron:
        if len(cron.split()) != 5:
            raise InvalidArgument("a cron expression has 5 fields", field="cron")
        return next_cron_ms(cron, timezone, now_ms)
    return at_ms


def after_firing(schedule: Schedule, now_ms: int) -> int | None:
    """When the schedule is due next once its due firing is done (None: it
    was a one-off, and is over). Missed times up to now are skipped."""
    if schedule.once:
        return None
    return next_cron_ms(schedule.cron, schedule.timezone, max(now_ms, schedule.next_fire_ms))


def request_id(schedule: Schedule) -> str:
    """The firing's input request id: the schedule and the time it was due."""
    return f"schedule-{schedule.schedule_id}-{schedule.next_fire_ms}"
