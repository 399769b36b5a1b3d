"""The runner's messages and their protobuf form, one codec per kind.

The servicer encodes with these and the client decodes with them, so the
shape of a delta, a status or a drain mode is spelled in one place.
"""

from __future__ import annotations

from keel.runner.v1 import runner_pb2 as pb
from kernel.domain import DrainMode
from services.runner.events import (
    COMPACTING,
    IDLE,
    RUNNING,
    Committed,
    Partial,
    ReplayEnd,
    SessionState,
    StatusChange,
    WatchEvent,
)

_STATE_TO_PB: dict[SessionState, pb.SessionState.ValueType] = {
    IDLE: pb.SESSION_STATE_IDLE,
    RUNNING: pb.SESSION_STATE_RUNNING,
    COMPACTING: pb.SESSION_STATE_COMPACTING,
}
_STATE_FROM_PB = {number: name for name, number in _STATE_TO_PB.items()}
# The modes of Runtime.drain_mode.
DRAIN_MODE_TO_PB: dict[DrainMode, pb.DrainMode.ValueType] = {
    DrainMode.NONE: pb.DRAIN_MODE_NONE,
    DrainMode.HANDOFF: pb.DRAIN_MODE_HANDOFF,
    DrainMode.SHUTDOWN: pb.DRAIN_MODE_SHUTDOWN,
}
DRAIN_MODE_FROM_PB = {number: name for name, number in DRAIN_MODE_TO_PB.items()}


def watch_event_to_pb(event: WatchEvent) -> pb.WatchSessionResponse:
    if isinstance(event, Partial):
        return pb.WatchSessionResponse(
            delta=pb.Delta(
                generation_id=event.generation_id,
                channel=event.channel,
                text=event.text,
                epoch=event.epoch,
                attempt_id=event.attempt_id,
                tool_call_id=event.tool_call_id,
                tool_name=event.tool_name,
            )
        )
    if isinstance(event, StatusChange):
        return pb.WatchSessionResponse(
            status=pb.Status(state=_STATE_TO_PB[event.state], epoch=event.epoch)
        )
    if isinstance(event, Committed):
        return pb.WatchSessionResponse(committed=pb.Committed(seq=event.seq))
    replay_end = pb.ReplayEnd(partials=event.partials)
    if event.committed is not None:
        replay_end.committed_seq = event.committed
    return pb.WatchSessionResponse(replay_end=replay_end)


def watch_event_from_pb(message: pb.WatchSessionResponse) -> WatchEvent | None:
    """The event, or None for a kind this client does not know (a newer runner)."""
    kind = message.WhichOneof("event")
    if kind == "delta":
        delta = message.delta
        return Partial(
            generation_id=delta.generation_id,
            channel=delta.channel,  # type: ignore[arg-type]
            text=delta.text,
            epoch=delta.epoch,
            attempt_id=delta.attempt_id,
            tool_call_id=delta.tool_call_id,
            tool_name=delta.tool_name,
        )
    if kind == "status":
        return StatusChange(_STATE_FROM_PB.get(message.status.state, IDLE), message.status.epoch)
    if kind == "replay_end":
        end = message.replay_end
        # Absent from an older runner, which sends no `Committed` marks.
        committed = end.committed_seq if end.HasField("committed_seq") else None
        return ReplayEnd(end.partials, committed)
    if kind == "committed":
        return Committed(message.committed.seq)
    return None
