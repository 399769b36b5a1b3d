"""What a client of a session is sent, encoded once per item for all its clients.

The fan-out (edge/fanout.py) wraps each item it broadcasts (a fact, a
partial, a status change) in one `Frame`, and every client of the session
gets that same object: its SSE bytes and its keel.sessions.v1 message are
computed by the first client that needs them and reused by the others, so
a fact followed by a thousand tabs is serialized once per front door, not a
thousand times.

`WireCodec` is the one place an item becomes bytes (SSE event or serialized
`StreamEventsResponse`); the hub holds one, so what is encoded, and how
often, can be observed there.
"""

from __future__ import annotations

import json
from typing import Any

from sse_starlette import ServerSentEvent

from keel.sessions.v1 import sessions_pb2 as pb
from services.common import tracing
from services.ledger import CommittedFact
from services.runner.events import COMPACTING, IDLE, RUNNING, Partial, SessionState, StatusChange

# The states a client is told of (a runner's other states are its own business).
CLIENT_STATES: frozenset[SessionState] = frozenset({IDLE, RUNNING, COMPACTING})


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def fact_json(fact: CommittedFact) -> dict[str, Any]:
    return {
        "seq": fact.seq,
        "kind": fact.kind,
        "timestamp": fact.timestamp_ms,
        "epoch": fact.epoch,
        "data": tracing.client_data(fact.kind, fact.data),
    }


def delta_json(partial: Partial) -> dict[str, Any]:
    """A partial as a client sees it. (generationId, epoch, attemptId) names
    one attempt's stream of a generation: a retried attempt reuses the
    generation id, so a client starts a new preview when any of the three
    changes. A tool-call fragment names its call, since parallel calls
    stream interleaved."""
    payload: dict[str, Any] = {
        "generationId": partial.generation_id,
        "epoch": partial.epoch,
        "attemptId": partial.attempt_id,
        "channel": partial.channel,
        "text": partial.text,
    }
    if partial.channel == "tool_call":
        payload["toolCallId"] = partial.tool_call_id
        payload["toolName"] = partial.tool_name
    return payload


def fact_event(fact: CommittedFact) -> ServerSentEvent:
    return ServerSentEvent(data=_json(fact_json(fact)), event=fact.kind, id=str(fact.seq))


def sse_event(item: object) -> ServerSentEvent | None:
    """An item as an SSE event (None: not shown to clients)."""
    if isinstance(item, CommittedFact):
        return fact_event(item)
    if isinstance(item, Partial):
        return ServerSentEvent(data=json.dumps(delta_json(item)), event="delta")
    if isinstance(item, StatusChange) and item.state in CLIENT_STATES:
        payload: dict[str, Any] = {"state": item.state}
        if item.epoch:
            payload["epoch"] = item.epoch
        return ServerSentEvent(data=json.dumps(payload), event="status")
    return None


def fact_pb(fact: CommittedFact) -> pb.Fact:
    return pb.Fact(
        seq=fact.seq,
        kind=fact.kind,
        timestamp_ms=fact.timestamp_ms,
        epoch=fact.epoch,
        data_json=_json(tracing.client_data(fact.kind, fact.data)),
    )


def event_pb(item: object) -> pb.StreamEventsResponse | None:
    """An item as a stream event of the gRPC API (None: not shown to clients)."""
    if isinstance(item, CommittedFact):
        return pb.StreamEventsResponse(fact=fact_pb(item))
    if isinstance(item, Partial):
        delta = pb.Delta(
            generation_id=item.generation_id,
            epoch=item.epoch,
            attempt_id=item.attempt_id,
            channel=item.channel,
            text=item.text,
            tool_call_id=item.tool_call_id,
            tool_name=item.tool_name,
        )
        return pb.StreamEventsResponse(delta=delta)
    if isinstance(item, StatusChange) and item.state in CLIENT_STATES:
        return pb.StreamEventsResponse(status=pb.Status(state=item.state, epoch=item.epoch))
    return None


class WireCodec:
    """Items to the bytes each front door writes."""

    def sse(self, item: object) -> bytes | None:
        event = sse_event(item)
        return event.encode() if event is not None else None

    def grpc(self, item: object) -> bytes | None:
        message = event_pb(item)
        return message.SerializeToString() if message is not None else None


_UNSET: Any = object()


class Frame:
    """One item for the clients of a session, with its encodings, each made
    at most once (and only if some client needs it)."""

    __slots__ = ("_codec", "_grpc", "_sse", "item")

    def __init__(self, item: object, codec: WireCodec) -> None:
        self.item = item
        self._codec = codec
        self._sse: bytes | None = _UNSET
        self._grpc: bytes | None = _UNSET

    @property
    def sse(self) -> bytes | None:
        """The SSE event (None: nothing to send for it)."""
        if self._sse is _UNSET:
            self._sse = self._codec.sse(self.item)
        return self._sse

    @property
    def grpc(self) -> bytes | None:
        """The serialized `StreamEventsResponse` (None: nothing to send)."""
        if self._grpc is _UNSET:
            self._grpc = self._codec.grpc(self.item)
        return self._grpc
