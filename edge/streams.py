"""One SSE stream per client: the session's facts, plus its owner's partials.

Facts come from the ledger's `Subscribe` from the client's cursor: the
backlog first, then live facts, in seq order, each with `id: <seq>`, so a
reconnect with `Last-Event-ID` resumes at cursor+1 with nothing missed or
repeated. Partials (`delta`, `status`) come from the runner that owns the
session, have no id (they are never facts), and start only once the backlog
has been sent. When the owner changes (takeover, handoff) the stream attaches
to the new owner by itself, prompted by the `epoch_started` fact, and gets
every delta of that attempt from its first token (see edge/fanout.py).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import Gauge
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from edge import metrics as edge_metrics
from edge.fanout import Drain, Live
from edge.gateway import Gateway
from edge.limits import StreamSlot
from services.common import tracing
from services.ledger import CommittedFact
from services.runner.hub import Partial

log = logging.getLogger("keel.edge.sse")

# The states a client is told of (a runner's other states are its own business).
CLIENT_STATES = frozenset({"idle", "running", "compacting"})


def fact_event(fact: CommittedFact) -> ServerSentEvent:
    return ServerSentEvent(
        data=json.dumps(fact_json(fact), ensure_ascii=False, separators=(",", ":")),
        event=fact.kind,
        id=str(fact.seq),
    )


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


class SessionStream:
    """One client's stream: shared facts and partials, plus the drain signal.

    Whatever the client has pending goes out as one chunk (one write), and
    `clients` (a gauge) counts the open streams.
    """

    def __init__(
        self, gateway: Gateway, session_id: str, after: int, clients: Gauge | None = None
    ) -> None:
        self._gateway = gateway
        self._session_id = session_id
        self._after = after
        self._clients = clients

    async def events(self) -> AsyncIterator[bytes]:
        follow = self._gateway.fanout.follow(self._session_id, self._after)
        if self._clients is not None:
            self._clients.inc()
        edge_metrics.sse_client_opened()
        try:
            async for batch in follow:
                events = [encoded for encoded in map(encode_once, batch) if encoded is not None]
                chunk, frames = b"".join(events), len(events)
                if isinstance(batch[-1], Drain):
                    retry = self._gateway.config.drain_retry_after_ms
                    chunk += ServerSentEvent(
                        data=json.dumps({"retry_after_ms": retry}), event="drain"
                    ).encode()
                    frames += 1
                if chunk:
                    yield chunk
                    edge_metrics.sse_frames_sent(frames)
        finally:
            if self._clients is not None:
                self._clients.dec()
            edge_metrics.sse_client_closed()
            await follow.aclose()


class LimitedEventSourceResponse(EventSourceResponse):
    """An SSE response that holds its stream slot (edge/limits.py) until it
    ends, however it ends: the client left, the edge drained, the stream
    failed, or it never started."""

    def __init__(self, stream: SessionStream, slot: StreamSlot, ping_s: float) -> None:
        super().__init__(
            stream.events(),
            ping=ping_s,
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
        self._slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()


class _EncodedOnce:
    """The wire bytes of a broadcast item, computed once for all its clients.

    The fan-out hands the same object to every client of a session; keying on
    the object (held, so its id cannot be reused) avoids serializing a fact
    a thousand times for a thousand tabs.
    """

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._cache: OrderedDict[int, tuple[object, bytes | None]] = OrderedDict()

    def __call__(self, item: Live) -> bytes | None:
        key = id(item)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is item:
            return hit[1]
        event = _to_event(item)
        encoded = event.encode() if event is not None else None
        self._cache[key] = (item, encoded)
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return encoded


encode_once = _EncodedOnce()


def _to_event(item: Live) -> ServerSentEvent | None:
    if isinstance(item, Drain):
        return None
    if isinstance(item, CommittedFact):
        return fact_event(item)
    if isinstance(item, Partial):
        return ServerSentEvent(data=json.dumps(delta_json(item)), event="delta")
    if item.state in CLIENT_STATES:
        payload_status: dict[str, Any] = {"state": item.state}
        if item.epoch:
            payload_status["epoch"] = item.epoch
        return ServerSentEvent(data=json.dumps(payload_status), event="status")
    return None
