"""`AppendPipeline`: a client's appends pipelined over one `AppendStream`.

A process has one LedgerClient per ledger target and so one pipeline: every
task that appends hands its request to the same long-lived stream, tagged
with an id, and waits for the answer with that id. No call per append, and
no waiting for one append's answer before the next is sent.

The stream is opened on the first append. When it fails (the ledger died,
the network went away, the ledger drained) every append still waiting fails
with a retryable `ServiceUnavailable`: whether it committed is unknown, as
after a failed unary call, and resending it is safe where dedup applies.
The next append opens a new stream, which the channel may place on another
ledger replica. A caller that is cancelled only stops waiting: its request
may still be sent and decided, and the stream carries on for everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from keel.ledger.v1 import ledger_pb2 as pb
from services.common import tracing
from services.common.errors import KeelError, ServiceUnavailable
from services.common.rpc import refusal_as_error, stream_answers
from services.ledger.errors import LedgerError

log = logging.getLogger(__name__)

# Opens an AppendStream whose requests are the given async iterator.
OpenStream = Callable[[AsyncIterator[pb.AppendStreamRequest]], Any]


class _Stream:
    """One opened AppendStream and the appends waiting for its answers."""

    def __init__(self, open_stream: OpenStream) -> None:
        self._outbox: deque[pb.AppendStreamRequest] = deque()
        self._has_mail = asyncio.Event()
        self._waiting: dict[int, asyncio.Future[pb.AppendResponse]] = {}
        self._next_id = 0
        self._ending = False
        # Set once the stream is over: nothing more is sent or answered.
        self.broken = False
        # gRPC sends the requests from its own task as this iterator yields
        # them, so no caller ever awaits a write (cancelling a write would
        # cancel the whole call).
        self._call = open_stream(self._requests())
        self._reader = asyncio.create_task(self._read_answers(), name="ledger-append-stream")

    def send(
        self, request: pb.AppendRequest, traceparent: str | None
    ) -> asyncio.Future[pb.AppendResponse]:
        self._next_id += 1
        answer: asyncio.Future[pb.AppendResponse] = asyncio.get_running_loop().create_future()
        self._waiting[self._next_id] = answer
        self._outbox.append(
            pb.AppendStreamRequest(id=self._next_id, append=request, traceparent=traceparent or "")
        )
        self._has_mail.set()
        return answer

    async def _requests(self) -> AsyncIterator[pb.AppendStreamRequest]:
        while True:
            while self._outbox:
                yield self._outbox.popleft()
            if self._ending:
                return
            self._has_mail.clear()
            await self._has_mail.wait()

    async def _read_answers(self) -> None:
        failure: KeelError | None = None
        try:
            async for response in stream_answers(self._call, LedgerError):
                self._settle(response)
        except KeelError as error:
            failure = error
        except asyncio.CancelledError:
            failure = ServiceUnavailable("the ledger append stream was closed")
            raise
        finally:
            self._end(failure or ServiceUnavailable("the ledger ended the append stream"))

    def _settle(self, response: pb.AppendStreamResponse) -> None:
        answer = self._waiting.pop(response.id, None)
        if answer is None or answer.done():  # its caller was cancelled
            return
        if response.WhichOneof("outcome") == "appended":
            answer.set_result(response.appended)
            return
        refused = response.error
        answer.set_exception(
            refusal_as_error(
                refused.code, refused.reason, refused.message, refused.metadata, LedgerError
            )
        )

    def _end(self, failure: KeelError) -> None:
        """Fails every append still waiting: the stream is gone."""
        self.broken = True
        self._ending = True
        self._has_mail.set()
        waiting, self._waiting = self._waiting, {}
        self._outbox.clear()
        if waiting:
            log.warning("ledger append stream ended with %d appends unanswered", len(waiting))
        for answer in waiting.values():
            if not answer.done():
                # One exception object per caller: each raises its own.
                answer.set_exception(type(failure)(failure.message, **failure.metadata))

    async def close(self) -> None:
        """Sends no more; waits briefly for the answers still owed, then ends."""
        self._ending = True
        self._has_mail.set()
        if self._waiting:
            # The server answers what it read, then ends the stream: a moment
            # for that, never a hang on a server that is gone.
            await asyncio.wait({self._reader}, timeout=2.0)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class AppendPipeline:
    """Every append of one LedgerClient, over one lazily opened stream."""

    def __init__(self, open_stream: OpenStream) -> None:
        self._open_stream = open_stream
        self._stream: _Stream | None = None
        self._closed = False

    async def append(self, request: pb.AppendRequest) -> pb.AppendResponse:
        if self._closed:
            raise ServiceUnavailable("the ledger client is closed")
        stream = self._stream
        if stream is None or stream.broken:
            stream = self._stream = _Stream(self._open_stream)
        # Not shielded: a cancelled caller drops its answer, nothing else.
        return await stream.send(request, tracing.current_traceparent())

    async def close(self) -> None:
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()
