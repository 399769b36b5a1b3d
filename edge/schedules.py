"""Scheduled inputs of a session, for the HTTP and gRPC APIs alike: a cron
expression read in an IANA time zone, or one RFC 3339 time. The kernel
keeps and fires them (kernel/schedules.py says how a firing is one input
across crashes and failover, and what missed firings do)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from edge import bodies
from edge.auth import Caller
from edge.bodies import ScheduleBody
from edge.errors import BadRequest, NotFound, from_service_error
from edge.gateway import Gateway
from kernel.schedules import Schedule
from services.common.errors import KeelError

# The last millisecond of year 9999: the latest time RFC 3339 can write.
MAX_AT_MS = 253_402_300_799_999


def rfc3339(ms: int) -> str:
    """A time (Unix ms, 1..MAX_AT_MS) as RFC 3339 in UTC."""
    if not 0 < ms <= MAX_AT_MS:
        raise BadRequest(f"a time must be between 1 and {MAX_AT_MS} ms", field="at")
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    shown: dict[str, Any] = {
        "id": schedule.schedule_id,
        "text": schedule.text,
        "nextFireAt": rfc3339(schedule.next_fire_ms),
        "createdAt": rfc3339(schedule.created_at_ms),
    }
    if schedule.cron:
        shown.update({"cron": schedule.cron, "timezone": schedule.timezone})
    else:
        shown["at"] = rfc3339(schedule.at_ms)
    return shown


def _at_ms(at: str) -> int:
    try:
        moment = dt.datetime.fromisoformat(at)
    except ValueError:
        raise BadRequest(
            "at must be an RFC 3339 time, e.g. 2026-12-24T18:00:00Z", field="at"
        ) from None
    if moment.tzinfo is None:
        raise BadRequest("at must say its offset (Z or +hh:mm)", field="at")
    return max(1, int(moment.timestamp() * 1000))


async def create(
    gateway: Gateway, caller: Caller, session_id: str, body: ScheduleBody | Mapping[str, Any]
) -> Schedule:
    body = bodies.convert(body, ScheduleBody)
    await gateway.session(caller, session_id)
    if (body.cron is None) == (body.at is None):
        raise BadRequest("a schedule has either `cron` (and `timezone`) or `at`", field="cron")
    try:
        return await gateway.kernel.create_schedule(
            caller.tenant_id,
            session_id,
            body.text,
            cron=body.cron or "",
            timezone=body.timezone or "UTC",
            at_ms=_at_ms(body.at) if body.at is not None else 0,
        )
    except KeelError as error:
        raise from_service_error(error) from None


async def listed(gateway: Gateway, caller: Caller, session_id: str) -> list[Schedule]:
    await gateway.session(caller, session_id)
    return await gateway.kernel.list_schedules(session_id)


async def delete(gateway: Gateway, caller: Caller, session_id: str, schedule_id: str) -> None:
    await gateway.session(caller, session_id)
    if not await gateway.kernel.delete_schedule(session_id, schedule_id[:64]):
        raise NotFound("the session has no such schedule (a one-off that fired is gone)")
