"""The kernel's calls on scheduled inputs (kernel.schedules): they validate
and hand over to the `ScheduleStore`; the kernel's firing loop
(kernel.scheduler) does the rest. A base class of the servicer, like
`kernel.tenancy_rpcs`, so its gRPC surface stays one class."""

from __future__ import annotations

import asyncio

from keel.kernel.v1 import kernel_pb2 as pb
from kernel.domain import check_id
from kernel.rpc_checks import Context, bounded_text, non_negative
from kernel.schedule_store import ScheduleStore
from kernel.schedules import Schedule
from services.common.errors import unary_errors


def schedule_to_pb(schedule: Schedule) -> pb.ScheduleInfo:
    return pb.ScheduleInfo(
        schedule_id=schedule.schedule_id,
        session_id=schedule.session_id,
        text=schedule.text,
        cron=schedule.cron,
        timezone=schedule.timezone,
        at_ms=schedule.at_ms,
        next_fire_ms=schedule.next_fire_ms,
        created_at_ms=schedule.created_at_ms,
    )


class ScheduleRpcs:
    """CreateSchedule, ListSchedules and DeleteSchedule."""

    # Set by KernelServicer.__init__.
    _schedules: ScheduleStore

    @unary_errors
    async def CreateSchedule(
        self, request: pb.CreateScheduleRequest, context: Context
    ) -> pb.CreateScheduleResponse:
        schedule = await asyncio.to_thread(
            self._schedules.create,
            check_id(request.tenant_id, "tenant_id"),
            check_id(request.session_id, "session_id"),
            request.text,
            bounded_text(request.cron, "cron", 256),
            bounded_text(request.timezone, "timezone", 64) or "UTC",
            non_negative(request.at_ms, "at_ms"),
        )
        return pb.CreateScheduleResponse(schedule=schedule_to_pb(schedule))

    @unary_errors
    async def ListSchedules(
        self, request: pb.ListSchedulesRequest, context: Context
    ) -> pb.ListSchedulesResponse:
        found = await asyncio.to_thread(
            self._schedules.of_session, check_id(request.session_id, "session_id")
        )
        return pb.ListSchedulesResponse(schedules=[schedule_to_pb(s) for s in found])

    @unary_errors
    async def DeleteSchedule(
        self, request: pb.DeleteScheduleRequest, context: Context
    ) -> pb.DeleteScheduleResponse:
        deleted = await asyncio.to_thread(
            self._schedules.delete,
            check_id(request.session_id, "session_id"),
            bounded_text(request.schedule_id, "schedule_id", 64),
        )
        return pb.DeleteScheduleResponse(deleted=deleted)
