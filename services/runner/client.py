"""`RunnerClient`: the typed async client of one runner (the edge uses it)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc

from keel.runner.v1 import runner_pb2 as pb
from keel.runner.v1 import runner_pb2_grpc as pb_grpc
from services.common.config import Settings
from services.common.errors import error_from_rpc, reasons_of
from services.common.serving import open_channel
from services.runner.errors import RunnerError
from services.runner.hub import Partial, ReplayEnd, StatusChange, WatchEvent

_REASONS = reasons_of(RunnerError)
_STATES = {
    pb.SESSION_STATE_IDLE: "idle",
    pb.SESSION_STATE_RUNNING: "running",
    pb.SESSION_STATE_COMPACTING: "compacting",
}
_MODES = {"handoff": pb.DRAIN_MODE_HANDOFF, "shutdown": pb.DRAIN_MODE_SHUTDOWN}
_MODE_NAMES = {
    pb.DRAIN_MODE_NONE: "none",
    pb.DRAIN_MODE_HANDOFF: "handoff",
    pb.DRAIN_MODE_SHUTDOWN: "shutdown",
}


@dataclass(frozen=True)
class RunnerStatus:
    runtime_id: str
    drain_mode: str
    claiming: bool
    in_flight_runs: int
    session_ids: tuple[str, ...]


class RunnerClient:
    def __init__(self, target: str, settings: Settings | None = None) -> None:
        self._channel = open_channel(target, settings or Settings())
        self._stub = pb_grpc.RunnerServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(None)

    async def __aenter__(self) -> RunnerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def watch(
        self, session_id: str, epoch: int = 0, attempt_id: str = ""
    ) -> AsyncGenerator[WatchEvent, None]:
        """A status first, then the attempt's partials (replayed, then live)
        while this runner owns the session, with a `ReplayEnd` between the
        two. Naming an attempt (`epoch`, `attempt_id`) replays it even just
        after it ended."""
        request = pb.WatchSessionRequest(session_id=session_id, epoch=epoch, attempt_id=attempt_id)
        call = self._stub.WatchSession(request)
        try:
            async for message in call:
                kind = message.WhichOneof("event")
                if kind == "delta":
                    yield _partial(message.delta)
                elif kind == "status":
                    state = _STATES.get(message.status.state, "idle")
                    yield StatusChange(state, message.status.epoch)  # type: ignore[arg-type]
                elif kind == "replay_end":
                    yield ReplayEnd(message.replay_end.partials)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, RunnerError, _REASONS) from None
        finally:
            call.cancel()

    async def drain(self, mode: str, deadline_ms: int = 30_000) -> int:
        if mode not in _MODES:
            raise ValueError(f"mode must be handoff or shutdown, got {mode!r}")
        try:
            response = await self._stub.Drain(
                pb.DrainRequest(mode=_MODES[mode], deadline_ms=deadline_ms)
            )
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, RunnerError, _REASONS) from None
        return response.in_flight_runs

    async def status(self) -> RunnerStatus:
        try:
            response = await self._stub.Status(pb.StatusRequest())
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, RunnerError, _REASONS) from None
        return RunnerStatus(
            runtime_id=response.runtime_id,
            drain_mode=_MODE_NAMES.get(response.drain_mode, "none"),
            claiming=response.claiming,
            in_flight_runs=response.in_flight_runs,
            session_ids=tuple(response.session_ids),
        )


def _partial(delta: pb.Delta) -> Partial:
    return Partial(
        generation_id=delta.generation_id,
        channel=delta.channel,  # type: ignore[arg-type]
        text=delta.text,
        epoch=delta.epoch,
        attempt_id=delta.attempt_id,
        tool_call_id=delta.tool_call_id,
        tool_name=delta.tool_name,
    )
