"""The runner's gRPC face: partials for the edge, drain and status for operators.

`WatchSession` names an attempt when the edge knows it (from the attempt's
epoch_started fact): the hub then replays that attempt even if it has just
ended here, marks where the replay ends, and marks each fact the attempt
commits after the partials before it (the edge holds the attempt's facts
until their mark, so an answer never overtakes its own preview).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from keel.runner.v1 import runner_pb2 as pb
from keel.runner.v1 import runner_pb2_grpc as pb_grpc
from kernel.domain import DrainMode
from services.common.errors import stream_errors, unary_errors
from services.common.serving import GrpcService
from services.runner.codec import DRAIN_MODE_FROM_PB, DRAIN_MODE_TO_PB, watch_event_to_pb
from services.runner.errors import InvalidDrain, SessionNotOwned
from services.runner.runtime import Runtime


class RunnerServicer(pb_grpc.RunnerServiceServicer):
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    @stream_errors
    async def WatchSession(
        self, request: pb.WatchSessionRequest, context: Any
    ) -> AsyncIterator[pb.WatchSessionResponse]:
        hub = self._runtime.hub
        session_id, epoch, attempt_id = request.session_id, request.epoch, request.attempt_id
        if not hub.watchable(session_id, epoch, attempt_id):
            named = f" attempt (epoch {epoch}, id {attempt_id!r})" if epoch or attempt_id else ""
            raise SessionNotOwned(
                f"runtime {self._runtime.runtime_id} does not own{named} {session_id!r}"
            )
        async for event in hub.watch(session_id, epoch, attempt_id):
            yield watch_event_to_pb(event)

    @unary_errors
    async def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainResponse:
        runtime = self._runtime
        if request.runtime_id and request.runtime_id != runtime.runtime_id:
            raise InvalidDrain(
                f"this is runtime {runtime.runtime_id}, not {request.runtime_id}",
                runtime_id=runtime.runtime_id,
            )
        mode = DRAIN_MODE_FROM_PB.get(request.mode)
        if mode is None:
            raise InvalidDrain("mode must be DRAIN_MODE_HANDOFF, DRAIN_MODE_SHUTDOWN or NONE")
        if request.deadline_ms < 0:
            raise InvalidDrain(f"deadline_ms must be >= 0, got {request.deadline_ms}")
        if mode == DrainMode.NONE:
            result = await runtime.undrain()
        else:
            deadline = request.deadline_ms or runtime.config.handoff_deadline_ms
            result = await runtime.drain(mode, deadline)
        return pb.DrainResponse(
            in_flight_runs=result.in_flight,
            stopped_runs=result.stopped,
            undone=result.undone,
            finished=result.finished,
        )

    @unary_errors
    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        runtime = self._runtime
        return pb.StatusResponse(
            runtime_id=runtime.runtime_id,
            drain_mode=DRAIN_MODE_TO_PB[runtime.drain_mode],
            claiming=runtime.claiming,
            in_flight_runs=len(runtime.in_flight),
            session_ids=sorted(runtime.in_flight),
        )


def runner_service(runtime: Runtime) -> GrpcService:
    servicer = RunnerServicer(runtime)

    async def on_drain() -> None:
        runtime.hub.close_all()

    return GrpcService(
        name=pb.DESCRIPTOR.services_by_name["RunnerService"].full_name,
        add_to_server=lambda server: pb_grpc.add_RunnerServiceServicer_to_server(servicer, server),
        on_drain=on_drain,
    )
