"""The kernel client's calls on scheduled inputs (the edge makes them);
`KernelClient` takes them in as a base class, as it does the tenancy calls."""

from __future__ import annotations

from keel.kernel.v1 import kernel_pb2 as pb
from keel.kernel.v1 import kernel_pb2_grpc as pb_grpc
from kernel.errors import KernelError
from kernel.schedules import Schedule
from services.common.rpc import unary


def schedule_from_pb(message: pb.ScheduleInfo, tenant_id: str = "") -> Schedule:
    return Schedule(
        message.schedule_id,
        tenant_id,
        message.session_id,
        message.text,
        message.cron,
        message.timezone,
        message.at_ms,
        message.next_fire_ms,
        message.created_at_ms,
    )


class ScheduleCalls:
    """create_schedule, list_schedules and delete_schedule."""

    # Set by KernelClient.__init__.
    _stub: pb_grpc.KernelServiceAsyncStub

    async def create_schedule(
        self,
        tenant_id: str,
        session_id: str,
        text: str,
        *,
        cron: str = "",
        timezone: str = "UTC",
        at_ms: int = 0,
    ) -> Schedule:
        """A recurring (`cron` in `timezone`) or one-off (`at_ms`) input."""
        request = pb.CreateScheduleRequest(
            tenant_id=tenant_id,
            session_id=session_id,
            text=text,
            cron=cron,
            timezone=timezone,
            at_ms=at_ms,
        )
        response = await unary(self._stub.CreateSchedule(request), KernelError)
        return schedule_from_pb(response.schedule, tenant_id)

    async def list_schedules(self, session_id: str) -> list[Schedule]:
        request = pb.ListSchedulesRequest(session_id=session_id)
        response = await unary(self._stub.ListSchedules(request), KernelError)
        return [schedule_from_pb(s) for s in response.schedules]

    async def delete_schedule(self, session_id: str, schedule_id: str) -> bool:
        request = pb.DeleteScheduleRequest(session_id=session_id, schedule_id=schedule_id)
        response = await unary(self._stub.DeleteSchedule(request), KernelError)
        return response.deleted
