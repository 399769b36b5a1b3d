"""The ledger's gRPC face: validation, the group committer, live subscriptions."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from opentelemetry import trace

from keel.ledger.v1 import ledger_pb2 as pb
from keel.ledger.v1 import ledger_pb2_grpc as pb_grpc
from services.common import hops, tracing
from services.common.config import Settings
from services.common.errors import (
    KeelError,
    ServiceUnavailable,
    as_reported,
    stream_errors,
    unary_errors,
)
from services.common.serving import MESSAGE_OVERHEAD_BYTES, GrpcService
from services.ledger import facts as F
from services.ledger.codec import fact_to_pb, read_response, settlement_from_pb, view_to_pb
from services.ledger.errors import (
    InvalidCursor,
    InvalidFact,
    InvalidSettlement,
    SessionNotFound,
    StaleEpoch,
)
from services.ledger.fact_schema import check_id
from services.ledger.group_commit import PendingAppend
from services.ledger.metrics import stale_append_refused, time_append
from services.ledger.packed_facts import MAX_PACKED_READ_LIMIT
from services.ledger.store import LedgerStore
from services.ledger.views import Appended, Settlement
from services.ledger.waker import SessionWaker

Context = grpc.aio.ServicerContext[Any, Any]
# A subscriber re-reads at least this often even without a wake-up, so a
# notification lost with a database connection delays a frame, never loses it.
SAFETY_POLL_S = 2.0
SUBSCRIBE_BATCH = 500
# Appends one AppendStream may have queued and not yet answered. Past it the
# stream stops reading, and HTTP/2 flow control holds the client back; the
# writer commits up to MAX_BATCH appends at once, one per session.
MAX_IN_FLIGHT_PER_STREAM = 512
APPEND_STREAM_METHOD = "keel.ledger.v1.LedgerService/AppendStream"
# The span of one append on the stream (a unary Append's is named by gRPC's
# instrumentation after its method, "/keel.ledger.v1.LedgerService/Append").
APPEND_SPAN = "/keel.ledger.v1.LedgerService/AppendStream/Append"

# Every append the fence refused, said where the refusal is decided: a
# fenced-off writer (a runner resumed after its lease was taken over) is
# seen here even when it gave up on its call before the answer came back.
fence_log = logging.getLogger(__name__)

Outcome = asyncio.Future[list[Appended]]


def note_refusal(session_id: str, epoch: int, kinds: Sequence[str]) -> Callable[[Outcome], None]:
    """A done-callback of an append's outcome that counts and logs a
    STALE_EPOCH refusal, as `stale append refused: session=… epoch=…
    fence=… kinds=…` (the fence is the session's current epoch)."""

    def settled(outcome: Outcome) -> None:
        if outcome.cancelled():
            return
        error = outcome.exception()  # also marks it retrieved
        if isinstance(error, StaleEpoch):
            stale_append_refused()
            fence_log.info(
                "stale append refused: session=%s epoch=%d fence=%s kinds=%s",
                session_id,
                epoch,
                error.metadata.get("fence", "?"),
                ",".join(kinds),
            )

    return settled


def settlement_of(request: pb.AppendRequest) -> Settlement | None:
    """The append's settlement, checked: only a runner's append (an epoch)
    carries one, with a runtime id and no negative number."""
    settle = settlement_from_pb(request)
    if settle is None:
        return None
    if request.epoch <= 0:
        raise InvalidSettlement("only an append with the runner's epoch settles a turn")
    check_id(settle.runtime_id, "settle.runtime_id")
    if settle.read_through < 0 or settle.sticky_ms < 0:
        raise InvalidSettlement("settle.read_through and settle.sticky_ms must be >= 0")
    return settle


def append_response(pending: PendingAppend) -> pb.AppendResponse:
    """The answer to a settled append (its outcome is a result)."""
    assert pending.aio_future is not None
    results = pending.aio_future.result()
    return pb.AppendResponse(
        results=[pb.AppendResult(seq=r.seq, duplicate=r.duplicate) for r in results],
        head_seq=max(r.seq for r in results),
        sticky_until_ms=pending.sticky_until_ms,
    )


def traced_append(
    request: pb.AppendStreamRequest,
) -> Callable[[Outcome], None]:
    """Starts the span of an append that came on the stream with its
    caller's trace context (gRPC's own spans are per call, not per message)
    and returns the done-callback that ends it with the outcome."""
    span = trace.get_tracer("keel.ledger").start_span(
        APPEND_SPAN,
        context=tracing.context_of(request.traceparent),
        kind=trace.SpanKind.SERVER,
        attributes={tracing.SESSION_ID: request.append.session_id, "rpc.method": "AppendStream"},
    )

    def settled(outcome: Outcome) -> None:
        error = None if outcome.cancelled() else outcome.exception()
        if isinstance(error, KeelError):
            span.set_status(trace.Status(trace.StatusCode.ERROR, error.reason))
        elif error is not None:
            span.record_exception(error)
            span.set_status(trace.Status(trace.StatusCode.ERROR))
        span.end()

    return settled


def refusal(request_id: int, error: Exception) -> pb.AppendStreamResponse:
    """An AppendStream answer saying what the unary Append's status would."""
    reported = as_reported(error, "AppendStream")
    return pb.AppendStreamResponse(
        id=request_id,
        error=pb.AppendError(
            code=reported.code.value[0],
            reason=reported.reason,
            message=reported.message,
            metadata=reported.metadata,
        ),
    )


class LedgerServicer(pb_grpc.LedgerServiceServicer):
    def __init__(self, store: LedgerStore, waker: SessionWaker, settings: Settings) -> None:
        self._store = store
        self._waker = waker
        self._settings = settings
        self._draining = asyncio.Event()
        # How to stop each open AppendStream reading (on drain).
        self._append_streams: set[Callable[..., object]] = set()

    async def drain(self) -> None:
        """Ends every Subscribe and AppendStream stream cleanly (status OK)."""
        self._draining.set()
        self._waker.wake_all()
        for stop_reading in list(self._append_streams):
            stop_reading()

    @unary_errors
    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Context
    ) -> pb.CreateSessionResponse:
        session_id = F.check_id(request.session_id, "session_id")
        tenant_id = F.check_id(request.tenant_id, "tenant_id")
        created = await asyncio.to_thread(self._store.create_session, session_id, tenant_id)
        return pb.CreateSessionResponse(session_id=session_id, created=created)

    @unary_errors
    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: Context
    ) -> pb.ForkSessionResponse:
        parent_id = F.check_id(request.parent_session_id, "parent_session_id")
        session_id = F.check_id(request.session_id, "session_id")
        if request.at_seq < 1:
            raise InvalidCursor(f"at_seq must be >= 1, got {request.at_seq}", field="at")
        head = await asyncio.to_thread(
            self._store.fork_session, parent_id, session_id, request.at_seq
        )
        return pb.ForkSessionResponse(head_seq=head)

    def submit_append(self, request: pb.AppendRequest) -> PendingAppend:
        """Validates an append and queues it for the writer: the one way in
        for `Append` and `AppendStream` alike. Raises what it refuses before
        queueing; the outcome (`aio_future`) counts and logs a fence refusal
        and its latency."""
        started = time.perf_counter()
        session_id = F.check_id(request.session_id, "session_id")
        if request.epoch < 0:
            raise InvalidFact(f"epoch must be >= 0, got {request.epoch}")
        if not request.facts:
            raise InvalidFact("an append needs at least one fact")
        if len(request.facts) > F.MAX_FACTS_PER_APPEND:
            raise InvalidFact(f"at most {F.MAX_FACTS_PER_APPEND} facts per append")
        new_facts = [
            F.parse_fact(f.kind, f.data_json, self._settings.max_fact_bytes) for f in request.facts
        ]
        pending = self._store.submit_async(
            session_id, new_facts, request.epoch, settlement_of(request), request.only_if_idle
        )
        outcome = pending.aio_future
        assert outcome is not None
        outcome.add_done_callback(
            note_refusal(session_id, request.epoch, [f.kind for f in new_facts])
        )
        outcome.add_done_callback(time_append(started))
        return pending

    @unary_errors
    async def Append(self, request: pb.AppendRequest, context: Context) -> pb.AppendResponse:
        pending = self.submit_append(request)
        assert pending.aio_future is not None
        # Shielded: a caller that goes away does not cancel the outcome, so
        # the decision (already queued) is still seen and counted.
        await asyncio.shield(pending.aio_future)
        return append_response(pending)

    @stream_errors
    async def AppendStream(
        self, requests: AsyncIterator[pb.AppendStreamRequest], context: Context
    ) -> AsyncIterator[pb.AppendStreamResponse]:
        """Reads appends while earlier ones are still being decided (up to
        MAX_IN_FLIGHT_PER_STREAM), and answers each as soon as its outcome is
        known. On drain it stops reading, answers what it read, and ends OK."""
        if self._draining.is_set():
            return  # opened as the server stops: the client goes elsewhere
        answers: deque[pb.AppendStreamResponse] = deque()
        wake = asyncio.Event()
        room = asyncio.Semaphore(MAX_IN_FLIGHT_PER_STREAM)
        in_flight = 0

        def answer(response: pb.AppendStreamResponse) -> None:
            answers.append(response)
            wake.set()

        def settled(request_id: int, pending: PendingAppend, outcome: Outcome) -> None:
            nonlocal in_flight
            in_flight -= 1
            room.release()
            error = (
                ServiceUnavailable("append cancelled")
                if outcome.cancelled()
                else outcome.exception()
            )
            if error is None:
                answer(pb.AppendStreamResponse(id=request_id, appended=append_response(pending)))
            else:
                # The store settles with an Exception, never a bare BaseException.
                assert isinstance(error, Exception)
                answer(refusal(request_id, error))

        async def read_requests() -> None:
            nonlocal in_flight
            async for request in requests:
                hops.called(APPEND_STREAM_METHOD)
                await room.acquire()
                try:
                    pending = self.submit_append(request.append)
                except Exception as error:  # refused before it was queued
                    room.release()
                    answer(refusal(request.id, error))
                    continue
                in_flight += 1
                outcome = pending.aio_future
                assert outcome is not None
                if request.traceparent and tracing.enabled():
                    outcome.add_done_callback(traced_append(request))
                outcome.add_done_callback(functools.partial(settled, request.id, pending))

        reader = asyncio.create_task(read_requests())
        reader.add_done_callback(lambda _: wake.set())
        stop_reading = reader.cancel
        self._append_streams.add(stop_reading)
        try:
            while True:
                await wake.wait()
                wake.clear()
                while answers:
                    yield answers.popleft()
                if reader.done() and in_flight == 0 and not answers:
                    break
            if not reader.cancelled():
                # A request stream that failed (the client went away) leaves
                # nobody to tell: the outcome is only marked as seen.
                reader.exception()
        finally:
            self._append_streams.discard(stop_reading)
            reader.cancel()

    @unary_errors
    async def Read(self, request: pb.ReadRequest, context: Context) -> pb.ReadResponse:
        session_id = F.check_id(request.session_id, "session_id")
        after = F.check_cursor(request.after_seq)
        if request.packed:
            return await self._read_packed(session_id, after, request)
        limit = F.check_limit(request.limit)
        facts, head = await asyncio.to_thread(self._store.read_page, session_id, after, limit)
        return read_response(facts, head)

    async def _read_packed(
        self, session_id: str, after: int, request: pb.ReadRequest
    ) -> pb.ReadResponse:
        if request.limit < 0 or request.max_packed_bytes < 0:
            raise InvalidCursor("limit and max_packed_bytes must be >= 0")
        limit = min(request.limit or F.DEFAULT_READ_LIMIT, MAX_PACKED_READ_LIMIT)
        max_bytes = self._settings.grpc_max_message_bytes - MESSAGE_OVERHEAD_BYTES
        if request.max_packed_bytes:
            max_bytes = min(max_bytes, request.max_packed_bytes)
        packed, head = await asyncio.to_thread(
            self._store.read_packed, session_id, after, limit, max_bytes
        )
        return pb.ReadResponse(packed_facts=packed, head_seq=head)

    @stream_errors
    async def Subscribe(
        self, request: pb.SubscribeRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeResponse]:
        session_id = F.check_id(request.session_id, "session_id")
        cursor = F.check_cursor(request.after_seq)
        if not await asyncio.to_thread(self._store.exists, session_id):
            raise SessionNotFound(f"no session {session_id!r}")
        # Registered before the first read, so a commit between a read that
        # came back empty and the wait below still wakes us. A fresh watch
        # must read: memory holds only what was committed after it began.
        watch = self._waker.watch(session_id)
        try:
            while not self._draining.is_set():
                watch.event.clear()
                remembered = None if watch.must_read else self._waker.after(session_id, cursor)
                if remembered is not None:
                    # What this ledger just committed, encoded once for all.
                    for response in remembered:
                        yield response
                        cursor = response.fact.seq
                else:
                    watch.must_read = False
                    facts = await asyncio.to_thread(
                        self._store.read, session_id, cursor, SUBSCRIBE_BATCH
                    )
                    for fact in facts:
                        yield pb.SubscribeResponse(fact=fact_to_pb(fact))
                        cursor = fact.seq
                    if len(facts) == SUBSCRIBE_BATCH:
                        continue
                # At the head: anything newer sets the event (cleared before
                # looking), so wait without reading.
                waits = [
                    asyncio.ensure_future(self._draining.wait()),
                    asyncio.ensure_future(watch.event.wait()),
                ]
                try:
                    done, _ = await asyncio.wait(
                        waits, timeout=SAFETY_POLL_S, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    for waiting in waits:
                        waiting.cancel()
                if not done:
                    # The safety poll: a notification may have been lost.
                    watch.must_read = True
        finally:
            self._waker.unwatch(session_id, watch)

    @unary_errors
    async def GetSession(
        self, request: pb.GetSessionRequest, context: Context
    ) -> pb.GetSessionResponse:
        session_id = F.check_id(request.session_id, "session_id")
        view = await asyncio.to_thread(self._store.view, session_id)
        return view_to_pb(view)

    @unary_errors
    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Context
    ) -> pb.ListSessionsResponse:
        if request.after_session_id:
            F.check_id(request.after_session_id, "after_session_id")
        limit = F.check_limit(request.limit)
        ids = await asyncio.to_thread(self._store.session_ids, request.after_session_id, limit)
        sessions: list[pb.SessionSummary] = []
        for session_id in ids:
            view = await asyncio.to_thread(self._store.view, session_id)
            if request.owing_only and not view.owes_work:
                continue
            sessions.append(
                pb.SessionSummary(
                    session_id=session_id,
                    tenant_id=view.tenant_id,
                    head_seq=view.head_seq,
                    owes_work=view.owes_work,
                )
            )
        # A full scan may have more behind it, whatever the filter kept.
        next_after = ids[-1] if len(ids) == limit else ""
        return pb.ListSessionsResponse(sessions=sessions, next_after_session_id=next_after)


def ledger_service(store: LedgerStore, waker: SessionWaker, settings: Settings) -> GrpcService:
    servicer = LedgerServicer(store, waker, settings)
    return GrpcService(
        name=pb.DESCRIPTOR.services_by_name["LedgerService"].full_name,
        add_to_server=lambda server: pb_grpc.add_LedgerServiceServicer_to_server(servicer, server),
        on_drain=servicer.drain,
    )
