"""The kernel's end of one `LeaseStream`: lease operations as messages.

A runner sends its claims, renewals, finishes and releases on one long-lived
stream instead of one call each (a call costs several times a message's
CPU). Each request is handled in a task of its own, so a claim long-polling
for work holds up nothing behind it; answers go out as they are ready, each
carrying its request's id. The operation itself is the servicer's, the one
its unary RPC runs (`LeaseOps`), and a refusal is answered with what that
RPC's status would have said (`LeaseStreamError`).

Loadouts: a claim asked for one answers with the tenant's latest revision,
and with its document only when this stream has not just sent that very
revision for that tenant. The answer that leaves the document out is queued
after the one that carried it (the check and the queueing happen with no
await in between), and the client reads answers in order, so it always has
the document a short answer refers to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from opentelemetry import trace

from keel.kernel.v1 import kernel_pb2 as pb
from kernel.codec import lease_stream_error_to_pb
from kernel.errors import InvalidArgument
from services.common import hops, tracing
from services.common.errors import as_reported

log = logging.getLogger(__name__)

LEASE_STREAM = "keel.kernel.v1.KernelService/LeaseStream"

# known(tenant_id, revision): this stream's client already holds that document.
KnownLoadout = Callable[[str, int], bool]


class LeaseOps(Protocol):
    """The servicer's lease operations, shared with the unary RPCs."""

    async def claim(
        self, request: pb.ClaimRequest, stream: LeaseStreamSession | None = None
    ) -> pb.ClaimResponse: ...

    async def renew(self, request: pb.RenewRequest) -> pb.RenewResponse: ...

    async def finish(
        self, request: pb.FinishRequest, stream: LeaseStreamSession | None = None
    ) -> pb.FinishResponse: ...

    async def release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse: ...


def _refusal(error: Exception) -> pb.LeaseStreamError:
    # A bug is logged with its traceback and answered as INTERNAL.
    return lease_stream_error_to_pb(as_reported(error, "KernelServicer.LeaseStream"))


class LeaseStreamSession:
    """The state of one stream: its operations in flight, and the loadout
    revision it last sent each tenant's document for."""

    def __init__(self, ops: LeaseOps) -> None:
        self._ops = ops
        # None ends the stream (every request read has been answered).
        self._answers: asyncio.Queue[pb.LeaseStreamResponse | None] = asyncio.Queue()
        self._working: dict[int, asyncio.Task[None]] = {}
        self._sent_loadouts: dict[str, int] = {}
        self._over = False

    async def serve(
        self, requests: AsyncIterator[pb.LeaseStreamRequest], end: asyncio.Event
    ) -> AsyncIterator[pb.LeaseStreamResponse]:
        """The answers, until the client stops sending (or `end` is set) and
        everything read has been answered."""
        running = asyncio.create_task(self._run(requests, end), name="lease-stream")
        try:
            while (answer := await self._answers.get()) is not None:
                yield answer
        finally:
            # The client is gone (or the server stops): a claim still
            # waiting is cancelled, which hands back a lease it took.
            self._over = True
            running.cancel()
            for task in list(self._working.values()):
                task.cancel()

    async def _run(
        self, requests: AsyncIterator[pb.LeaseStreamRequest], end: asyncio.Event
    ) -> None:
        try:
            reading = asyncio.create_task(self._read(requests))
            ending = asyncio.create_task(end.wait())
            try:
                await asyncio.wait({reading, ending}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (reading, ending):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            # What was read is answered before the stream ends (a drain's
            # claims return at once: the kernel no longer grants leases).
            working = set(self._working.values())
            if working:
                await asyncio.wait(working)
        finally:
            self._over = True
            self._answers.put_nowait(None)

    async def _read(self, requests: AsyncIterator[pb.LeaseStreamRequest]) -> None:
        async for request in requests:
            hops.called(LEASE_STREAM)
            self._take(request)

    def _take(self, request: pb.LeaseStreamRequest) -> None:
        kind = request.WhichOneof("operation")
        if kind == "cancel":
            withdrawn = self._working.get(request.id)
            if withdrawn is not None:
                withdrawn.cancel()
            return
        if kind is None or request.id in self._working:
            problem = "names no operation" if kind is None else "reuses the id of one unanswered"
            refusal = InvalidArgument(f"a LeaseStream request {problem}", field="id")
            self._answers.put_nowait(pb.LeaseStreamResponse(id=request.id, error=_refusal(refusal)))
            return
        task = asyncio.create_task(self._answer(request, kind))
        self._working[request.id] = task
        task.add_done_callback(lambda _: self._working.pop(request.id, None))

    def known(self, tenant_id: str, revision: int) -> bool:
        return self._sent_loadouts.get(tenant_id) == revision

    def send_wake(self, wake: pb.ClaimResponse) -> bool:
        """Queues an unasked wake (id 0) for a sticky session of this
        stream's runner; False once the stream is over."""
        if self._over:
            return False
        if wake.HasField("loadout") and wake.loadout.document_json:
            self._sent_loadouts[wake.lease.tenant_id] = wake.loadout.revision
        self._answers.put_nowait(pb.LeaseStreamResponse(id=0, wake=wake))
        return True

    async def _answer(self, request: pb.LeaseStreamRequest, kind: str) -> None:
        if request.traceparent and tracing.enabled():
            # Named as gRPC's instrumentation names the unary RPC's span,
            # under the stream: "/keel.kernel.v1.KernelService/LeaseStream/Finish".
            name = f"/{LEASE_STREAM}/{kind.capitalize()}"
            with trace.get_tracer("keel.kernel").start_as_current_span(
                name,
                context=tracing.context_of(request.traceparent),
                kind=trace.SpanKind.SERVER,
                attributes={"rpc.method": "LeaseStream"},
            ):
                await self._decide(request, kind)
        else:
            await self._decide(request, kind)

    async def _decide(self, request: pb.LeaseStreamRequest, kind: str) -> None:
        try:
            if kind == "claim":
                claimed = await self._ops.claim(request.claim, self)
                if claimed.HasField("loadout") and claimed.loadout.document_json:
                    # No await between this and the queueing below.
                    self._sent_loadouts[claimed.lease.tenant_id] = claimed.loadout.revision
                answer = pb.LeaseStreamResponse(id=request.id, claim=claimed)
            elif kind == "renew":
                renewed = await self._ops.renew(request.renew)
                answer = pb.LeaseStreamResponse(id=request.id, renew=renewed)
            elif kind == "finish":
                finished = await self._ops.finish(request.finish, self)
                answer = pb.LeaseStreamResponse(id=request.id, finish=finished)
            else:
                released = await self._ops.release(request.release)
                answer = pb.LeaseStreamResponse(id=request.id, release=released)
        except asyncio.CancelledError:
            raise  # withdrawn, or the stream is over: nobody to answer
        except Exception as error:
            answer = pb.LeaseStreamResponse(id=request.id, error=_refusal(error))
        self._answers.put_nowait(answer)
