"""`events()`: a session's stream that survives dropped connections.

The server sends facts from `after_seq + 1` (backlog, then live) with
partials and status changes between them. This iterator keeps the seq of the
last fact it yielded and, whenever the stream ends for a reason that is not
the caller's (the connection dropped, UNAVAILABLE, the edge restarted, a
`drain` notice), opens a new one with `after_seq` = that seq, after a
bounded, jittered exponential backoff (a drain names its own wait).

The guarantee is about facts: each seq is yielded once, in order, with no
gap. It is checked, not assumed: a fact that is not `last + 1` raises
`StreamOutOfOrder` rather than reaching the caller. Deltas carry no seq; an
attempt's deltas come again from its first token after a reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Sequence

import grpc

from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from keel_client._config import ReconnectPolicy
from keel_client._errors import (
    ClientClosed,
    InvalidArgument,
    KeelClientError,
    ReconnectGaveUp,
    StreamOutOfOrder,
    Unavailable,
    error_from_rpc,
)
from keel_client._types import Delta, Event, Fact, Status

log = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str]]


async def follow_session(
    stub: pb_grpc.SessionServiceAsyncStub,
    session_id: str,
    after: int,
    metadata: Metadata,
    policy: ReconnectPolicy,
    closed: Callable[[], bool],
) -> AsyncGenerator[Event, None]:
    """The events of `session_id` after fact `after`, reconnecting as needed."""
    if after < 0:
        raise InvalidArgument("after must be 0 or a fact's seq", metadata={"field": "after"})
    last_seq = after
    failures = 0
    # When the streams stopped delivering; None while one delivers.
    outage_since: float | None = None
    rng = random.Random()
    while True:
        if closed():
            raise ClientClosed("the client was closed")
        call = stub.StreamEvents(
            pb.StreamEventsRequest(session_id=session_id, after_seq=last_seq), metadata=metadata
        )
        drain_wait_s: float | None = None
        last_error: KeelClientError
        try:
            async for message in call:
                failures, outage_since = 0, None
                kind = message.WhichOneof("event")
                if kind == "fact":
                    if message.fact.seq != last_seq + 1:
                        raise StreamOutOfOrder(
                            f"session {session_id!r}: expected fact {last_seq + 1}, "
                            f"the server sent {message.fact.seq}",
                            expected_seq=last_seq + 1,
                            got_seq=message.fact.seq,
                        )
                    fact = Fact.from_pb(message.fact)
                    last_seq = fact.seq
                    yield fact
                elif kind == "delta":
                    yield Delta.from_pb(message.delta)
                elif kind == "status":
                    yield Status.from_pb(message.status)
                elif kind == "drain":
                    drain_wait_s = message.drain.retry_after_ms / 1000
                    break
                # Any other kind is newer than this client: skipped.
            # The server closed the stream without an error: it was stopped.
            last_error = Unavailable("the edge ended the event stream", reason="STREAM_ENDED")
        except grpc.aio.AioRpcError as err:
            if closed():
                # The client's channel was closed under the stream.
                raise ClientClosed("the client was closed") from None
            error = error_from_rpc(err)
            if not isinstance(error, Unavailable):
                raise error from None
            last_error = error
        finally:
            call.cancel()
        if drain_wait_s is not None:
            # A draining edge is an orderly handoff, not an outage: wait as
            # asked (spread a little, so its clients do not return at once).
            wait_s = drain_wait_s * (1 + policy.jitter * rng.random())
            log.info(
                "session %s: the edge is draining; resuming after fact %d in %.2fs",
                session_id,
                last_seq,
                wait_s,
            )
            await asyncio.sleep(wait_s)
            continue
        now = time.monotonic()
        outage_since = now if outage_since is None else outage_since
        waited = now - outage_since
        if policy.give_up_after_s is not None and waited >= policy.give_up_after_s:
            raise ReconnectGaveUp(
                f"session {session_id!r}: no event stream for {waited:.1f}s "
                f"(last error: {last_error}); resume with after={last_seq}",
                last_seq=last_seq,
            ) from last_error
        wait_s = policy.backoff_s(failures, rng)
        log.info(
            "session %s: event stream lost (%s); resuming after fact %d in %.2fs",
            session_id,
            last_error,
            last_seq,
            wait_s,
        )
        await asyncio.sleep(wait_s)
        failures += 1
