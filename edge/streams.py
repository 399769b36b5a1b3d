"""One SSE stream per client: the session's facts, plus its owner's partials.

Facts come from the ledger's `Subscribe` from the client's cursor: the
backlog first, then live facts, in seq order, each with `id: <seq>`, so a
reconnect with `Last-Event-ID` resumes at cursor+1 with nothing missed or
repeated. Partials (`delta`, `status`) come from the runner that owns the
session, have no id (they are never facts), and start only once the backlog
has been sent. When the owner changes (takeover, handoff) the stream attaches
to the new owner by itself, prompted by the `epoch_started` fact, and gets
every delta of that attempt from its first token (see edge/fanout.py).

The events are the fan-out's shared frames (edge/frames.py), encoded once
for all the session's clients. Once a client has caught up, the fan-out
writes live frames straight to its connection (`DIRECT_BODY`, which the
edge's HTTP protocol offers, edge/slow_clients.py) rather than waking this
stream's task for each; whatever cannot go that way comes through here.

A stream ends when the key it was opened with is revoked (edge/key_streams.py):
its last event is then `event: revoked` with `{"code": "key_revoked",
"message": …}`, and the connection closes (a client that opens it again is
refused with 401). The fan-out's direct writes stop at the revocation too
(`_UntilEnded`), before the stream's own wait is interrupted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from prometheus_client import Gauge
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from edge import metrics as edge_metrics
from edge.auth import Caller
from edge.fanout import Drain
from edge.fanout_clients import DirectSink
from edge.frames import CLIENT_STATES, delta_json, fact_event, fact_json
from edge.gateway import Gateway
from edge.key_streams import KeyRevoked, KeyUnconfirmed, OpenStream
from edge.limits import StreamSlot
from edge.slow_clients import DIRECT_BODY

__all__ = [
    "CLIENT_STATES",
    "DIRECT_BODY",
    "LimitedEventSourceResponse",
    "SessionStream",
    "delta_json",
    "fact_event",
    "fact_json",
]

log = logging.getLogger(__name__)


class _UntilEnded:
    """The connection as the fan-out writes to it directly, until the
    stream is ended (a write then fails, and the frame waits for the
    stream's own reader, which is being ended)."""

    __slots__ = ("_sink", "_stream")

    def __init__(self, sink: DirectSink, stream: OpenStream) -> None:
        self._sink = sink
        self._stream = stream

    def write(self, data: bytes) -> bool:
        return self._stream.ended_by is None and self._sink.write(data)


class SessionStream:
    """One client's stream: shared facts and partials, plus the drain signal.

    Whatever the client has pending goes out as one chunk (one write), and
    `clients` (a gauge) counts the open streams.
    """

    def __init__(
        self,
        gateway: Gateway,
        session_id: str,
        after: int,
        clients: Gauge | None = None,
        *,
        caller: Caller,
    ) -> None:
        self._gateway = gateway
        self._caller = caller
        self._session_id = session_id
        self._after = after
        self._clients = clients
        # The connection, for the fan-out to write live frames to (set by
        # the response once it knows its request).
        self.sink: DirectSink | None = None

    async def events(self) -> AsyncIterator[bytes]:
        with self._gateway.auth.open_stream(self._caller) as open_stream:
            sink = _UntilEnded(self.sink, open_stream) if self.sink is not None else None
            follow = self._gateway.fanout.follow_frames(self._session_id, self._after, sink)
            if self._clients is not None:
                self._clients.inc()
            edge_metrics.sse_client_opened()
            try:
                while (batch := await open_stream.next(follow)) is not None:
                    events = [encoded for encoded in (frame.sse for frame in batch) if encoded]
                    chunk, frames = b"".join(events), len(events)
                    if isinstance(batch[-1].item, Drain):
                        retry = self._gateway.config.drain_retry_after_ms
                        chunk += ServerSentEvent(
                            data=json.dumps({"retry_after_ms": retry}), event="drain"
                        ).encode()
                        frames += 1
                    if chunk:
                        yield chunk
                        edge_metrics.sse_frames_sent(frames)
            except KeyRevoked as revoked:
                yield ServerSentEvent(
                    data=json.dumps({"code": revoked.code, "message": revoked.message}),
                    event="revoked",
                ).encode()
            except KeyUnconfirmed:
                pass  # the stream just ends: the client reconnects, and is checked again
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
        self._stream = stream
        self._slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            sink = scope.get("extensions", {}).get(DIRECT_BODY, {}).get("sink")
            if isinstance(sink, DirectSink):
                self._stream.sink = sink
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()
