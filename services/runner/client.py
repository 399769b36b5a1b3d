"""`RunnerClient`: the typed async client of one runner (the edge uses it)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from keel.runner.v1 import runner_pb2 as pb
from keel.runner.v1 import runner_pb2_grpc as pb_grpc
from kernel.domain import DrainMode
from services.common.config import Settings
from services.common.rpc import streaming, unary
from services.common.serving import open_channel
from services.runner.codec import DRAIN_MODE_FROM_PB, DRAIN_MODE_TO_PB, watch_event_from_pb
from services.runner.errors import RunnerError
from services.runner.events import WatchEvent


@dataclass(frozen=True)
class DrainOutcome:
    # Runs in flight when the drain began.
    in_flight_runs: int
    # Stopped where they were (shutdown, or past the handoff deadline).
    stopped_runs: int
    # Undone before it finished: the runner claims again.
    undone: bool
    # Finished: the runner exits and is replaced.
    finished: bool


@dataclass(frozen=True)
class RunnerStatus:
    runtime_id: str
    drain_mode: DrainMode
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
        async for message in streaming(call, RunnerError):
            event = watch_event_from_pb(message)
            if event is not None:
                yield event

    async def drain(self, mode: DrainMode | str, deadline_ms: int = 0, runtime_id: str = "") -> int:
        """Drains the runner; returns the runs in flight when it began."""
        return (await self.drain_outcome(mode, deadline_ms, runtime_id)).in_flight_runs

    async def drain_outcome(
        self, mode: DrainMode | str, deadline_ms: int = 0, runtime_id: str = ""
    ) -> DrainOutcome:
        """Drains the runner (mode handoff or shutdown; returns once the
        drain has finished) or undoes its unfinished drain (mode "none").
        `deadline_ms` 0: the runner's own (KEEL_DRAIN_DEADLINE_MS);
        `runtime_id`: refused unless the runner is that runtime."""
        if mode not in tuple(DrainMode):
            raise ValueError(f"mode must be handoff, shutdown or none, got {mode!r}")
        request = pb.DrainRequest(
            mode=DRAIN_MODE_TO_PB[DrainMode(mode)], deadline_ms=deadline_ms, runtime_id=runtime_id
        )
        response = await unary(self._stub.Drain(request), RunnerError)
        return DrainOutcome(
            in_flight_runs=response.in_flight_runs,
            stopped_runs=response.stopped_runs,
            undone=response.undone,
            finished=response.finished,
        )

    async def status(self) -> RunnerStatus:
        response = await unary(self._stub.Status(pb.StatusRequest()), RunnerError)
        return RunnerStatus(
            runtime_id=response.runtime_id,
            drain_mode=DRAIN_MODE_FROM_PB.get(response.drain_mode, DrainMode.NONE),
            claiming=response.claiming,
            in_flight_runs=response.in_flight_runs,
            session_ids=tuple(response.session_ids),
        )
