"""The client's end of `LeaseStream`: one stream per client, opened on the
first lease operation and opened again after a failure.

Each operation is a request with an id of its own and a future its caller
awaits; the stream's reader resolves futures as answers come, in whatever
order. A refusal raises the same exception the unary RPC raises. When the
stream fails, every operation still unanswered raises `StreamBroken` (a
`ServiceUnavailable`: it may or may not have taken effect, as with a unary
call that failed UNAVAILABLE), and the next operation opens a new stream,
which the channel may place on another kernel replica.

Wakes: the kernel sends an unasked `wake` (id 0) for a session this client
keeps in a sticky window. They queue in `wakes` once `accept_wakes` is set
(a runner that asks for windows reads them); without, a wake's lease is
released at once, as an unwanted claim's.

A caller that stops waiting (cancelled, or past its deadline) withdraws its
request. A claim answered with a lease nobody waits for any more (the
withdrawal came too late) is released at once, as the kernel does for a
unary claim whose caller left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable

from keel.kernel.v1 import kernel_pb2 as pb
from keel.kernel.v1 import kernel_pb2_grpc as pb_grpc
from kernel.codec import lease_stream_error_from_pb
from kernel.errors import KernelError
from services.common import tracing
from services.common.errors import KeelError, ServiceUnavailable, Unimplemented
from services.common.rpc import streaming, unary

log = logging.getLogger(__name__)


class StreamBroken(ServiceUnavailable):
    """The lease stream failed before this operation was answered."""


class StreamLink:
    """One LeaseStream call and the operations waiting on it."""

    def __init__(
        self,
        stub: pb_grpc.KernelServiceAsyncStub,
        on_orphan: Callable[[pb.Lease], None],
        on_wake: Callable[[pb.ClaimResponse, StreamLink], None],
    ) -> None:
        self._outbox: asyncio.Queue[pb.LeaseStreamRequest | None] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[pb.LeaseStreamResponse]] = {}
        # tenant -> (revision, document JSON) of the loadout this stream sent last.
        self.loadouts: dict[str, tuple[int, str]] = {}
        self._on_orphan = on_orphan
        self._on_wake = on_wake
        self.broken = False
        self._call = stub.LeaseStream(self._requests())
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), name="kernel-lease-stream"
        )

    async def _requests(self) -> AsyncIterator[pb.LeaseStreamRequest]:
        while (request := await self._outbox.get()) is not None:
            yield request

    def send(self, request: pb.LeaseStreamRequest) -> asyncio.Future[pb.LeaseStreamResponse]:
        answered: asyncio.Future[pb.LeaseStreamResponse] = (
            asyncio.get_running_loop().create_future()
        )
        if self.broken:
            answered.set_exception(StreamBroken("the lease stream has failed"))
            return answered
        self._waiting[request.id] = answered
        self._outbox.put_nowait(request)
        return answered

    def withdraw(self, request_id: int) -> None:
        if self._waiting.pop(request_id, None) is not None and not self.broken:
            self._outbox.put_nowait(
                pb.LeaseStreamRequest(id=request_id, cancel=pb.CancelLeaseRequest())
            )

    async def _read(self) -> None:
        failure: KeelError = StreamBroken("the kernel ended the lease stream")
        try:
            async for answer in streaming(self._call, KernelError):
                self._deliver(answer)
        except KeelError as error:
            failure = _stream_failure(error)
        except asyncio.CancelledError:
            failure = StreamBroken("the lease stream was closed")
            raise
        finally:
            self.broken = True
            waiting, self._waiting = self._waiting, {}
            for answered in waiting.values():
                if not answered.done():
                    # One exception object per caller: each raises its own.
                    answered.set_exception(type(failure)(failure.message, **failure.metadata))

    def _deliver(self, answer: pb.LeaseStreamResponse) -> None:
        outcome = answer.WhichOneof("outcome")
        claimed = getattr(answer, outcome) if outcome in ("claim", "wake") else None
        if claimed is not None and claimed.loadout.document_json:
            # Kept even from an answer nobody waits for: a later answer that
            # leaves this document out refers to it.
            loadout = claimed.loadout
            self.loadouts[claimed.lease.tenant_id] = (loadout.revision, loadout.document_json)
        if outcome == "wake":
            self._on_wake(answer.wake, self)
            return
        answered = self._waiting.pop(answer.id, None)
        if answered is not None and not answered.done():
            answered.set_result(answer)
        else:
            self.unwanted(answer)

    def unwanted(self, answer: pb.LeaseStreamResponse) -> None:
        """An answer whose caller has left: a lease it grants is given back."""
        if answer.WhichOneof("outcome") == "claim" and answer.claim.HasField("lease"):
            self._on_orphan(answer.claim.lease)

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


def _stream_failure(error: KeelError) -> KeelError:
    """What the unanswered operations of a failed stream raise: the stream's
    own refusal when it was refused by name (e.g. a wrong internal token),
    else (the kernel died, the connection broke or was cancelled) a
    retryable `StreamBroken`, their outcome unknown."""
    if type(error) is KernelError or isinstance(error, ServiceUnavailable):
        return StreamBroken(f"the lease stream failed: {error.message}")
    return error


class LeaseStreamClient:
    """Sends lease operations on the current stream (opening one if needed).

    A kernel older than LeaseStream (a rolling upgrade that reached runners
    first) answers UNIMPLEMENTED: from then on this client sends each
    operation as the unary RPC it stands for, as runners did before.
    """

    def __init__(self, stub: pb_grpc.KernelServiceAsyncStub) -> None:
        self._stub = stub
        self._link: StreamLink | None = None
        self._ids = itertools.count(1)
        self._releasing: set[asyncio.Task[None]] = set()
        self.unary_only = False
        self.accept_wakes = False
        self.wakes: asyncio.Queue[tuple[pb.ClaimResponse, StreamLink]] = asyncio.Queue()

    def _current(self) -> StreamLink:
        link = self._link
        if link is None or link.broken:
            link = self._link = StreamLink(self._stub, self._release_orphan, self._woken)
        return link

    @property
    def streaming(self) -> bool:
        """Lease operations go over a stream that is up (a wake can come)."""
        return not self.unary_only and self._link is not None and not self._link.broken

    def _woken(self, wake: pb.ClaimResponse, link: StreamLink) -> None:
        if not wake.HasField("lease"):
            return
        if self.accept_wakes:
            self.wakes.put_nowait((wake, link))
        else:
            self._release_orphan(wake.lease)

    async def call(
        self, request: pb.LeaseStreamRequest, timeout_s: float | None = None
    ) -> tuple[pb.LeaseStreamResponse, StreamLink | None]:
        """The answer to `request` (its id is set here) and the stream that
        answered it; raises the kernel's refusal as its exception."""
        if self.unary_only:
            return await self._call_unary(request, timeout_s)
        try:
            return await self._call_stream(request, timeout_s)
        except Unimplemented:
            log.warning("the kernel has no LeaseStream (an older version): unary lease calls")
            self.unary_only = True
            return await self._call_unary(request, timeout_s)

    async def _call_unary(
        self, request: pb.LeaseStreamRequest, timeout_s: float | None
    ) -> tuple[pb.LeaseStreamResponse, None]:
        """`request` as the unary RPC it stands for, answered in the stream's
        shape (a claim then carries no loadout: the caller asks for it)."""
        stub, answer = self._stub, pb.LeaseStreamResponse(id=request.id)
        which = request.WhichOneof("operation")
        if which == "claim":
            answer.claim.CopyFrom(
                await unary(stub.Claim(request.claim, timeout=timeout_s), KernelError)
            )
        elif which == "renew":
            answer.renew.CopyFrom(await unary(stub.Renew(request.renew), KernelError))
        elif which == "finish":
            answer.finish.CopyFrom(await unary(stub.Finish(request.finish), KernelError))
        elif which == "release":
            await unary(stub.Release(request.release), KernelError)
            answer.release.SetInParent()  # an empty message, but the outcome
        else:
            raise ValueError(f"no unary RPC for a lease stream {which!r}")
        return answer, None

    async def _call_stream(
        self, request: pb.LeaseStreamRequest, timeout_s: float | None
    ) -> tuple[pb.LeaseStreamResponse, StreamLink]:
        link = self._current()
        request.id = next(self._ids)
        request.traceparent = tracing.current_traceparent() or ""
        answered = link.send(request)
        try:
            if timeout_s is None:
                answer = await answered
            else:
                answer = await asyncio.wait_for(answered, timeout_s)
        except TimeoutError:
            link.withdraw(request.id)
            raise StreamBroken(f"no answer on the lease stream within {timeout_s:.0f}s") from None
        except asyncio.CancelledError:
            if answered.done() and not answered.cancelled() and answered.exception() is None:
                # Answered, but cancelled before it could take the answer.
                link.unwanted(answered.result())
            else:
                link.withdraw(request.id)
            raise
        if answer.WhichOneof("outcome") == "error":
            raise lease_stream_error_from_pb(answer.error)
        return answer, link

    def _release_orphan(self, lease: pb.Lease) -> None:
        task = asyncio.get_running_loop().create_task(self._release(lease))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release(self, lease: pb.Lease) -> None:
        request = pb.LeaseStreamRequest(
            release=pb.ReleaseRequest(
                session_id=lease.session_id, epoch=lease.epoch, runtime_id=lease.runtime_id
            )
        )
        try:
            await self.call(request)
        except KeelError as error:
            # The lease lives until its TTL (or until this runtime detaches).
            log.warning("could not release an unwanted lease of %s: %s", lease.session_id, error)

    async def close(self) -> None:
        releasing = list(self._releasing)
        if releasing:
            # Hand-backs of unwanted leases finish first: they free sessions.
            await asyncio.wait(releasing, timeout=5)
        link, self._link = self._link, None
        if link is not None:
            await link.close()
