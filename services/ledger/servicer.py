"""The ledger's gRPC face: validation, the group committer, live subscriptions."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any

import grpc
from opentelemetry import metrics

from keel.ledger.v1 import ledger_pb2 as pb
from keel.ledger.v1 import ledger_pb2_grpc as pb_grpc
from services.common.config import Settings
from services.common.errors import stream_errors, unary_errors
from services.common.serving import GrpcService
from services.ledger import facts as F
from services.ledger.codec import fact_to_pb, view_to_pb
from services.ledger.domain import Appended
from services.ledger.errors import InvalidFact, SessionNotFound, StaleEpoch
from services.ledger.metrics import time_append
from services.ledger.store import LedgerStore

Context = grpc.aio.ServicerContext[Any, Any]
# A subscriber re-reads at least this often even without a wake-up, so a
# notification lost with a database connection delays a frame, never loses it.
SAFETY_POLL_S = 2.0
SUBSCRIBE_BATCH = 500

# Every append the fence refused, said where the refusal is decided: a
# fenced-off writer (a runner resumed after its lease was taken over) is
# seen here even when it gave up on its call before the answer came back.
fence_log = logging.getLogger("keel.ledger.fence")
_stale_appends = metrics.get_meter("keel.ledger").create_counter(
    "keel.ledger.stale_appends", description="appends refused by the fence (STALE_EPOCH)"
)


def note_refusal(
    session_id: str, epoch: int, kinds: Sequence[str]
) -> Callable[[asyncio.Future[list[Appended]]], None]:
    """A done-callback of an append's outcome that counts and logs a
    STALE_EPOCH refusal, as `stale append refused: session=… epoch=…
    fence=… kinds=…` (the fence is the session's current epoch)."""

    def settled(outcome: asyncio.Future[list[Appended]]) -> None:
        if outcome.cancelled():
            return
        error = outcome.exception()  # also marks it retrieved
        if isinstance(error, StaleEpoch):
            _stale_appends.add(1)
            fence_log.info(
                "stale append refused: session=%s epoch=%d fence=%s kinds=%s",
                session_id,
                epoch,
                error.metadata.get("fence", "?"),
                ",".join(kinds),
            )

    return settled


class SessionWaker:
    """Wakes the subscribers of sessions that just committed (thread-safe)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchers: defaultdict[str, set[asyncio.Event]] = defaultdict(set)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def watch(self, session_id: str) -> asyncio.Event:
        event = asyncio.Event()
        self._watchers[session_id].add(event)
        return event

    def unwatch(self, session_id: str, event: asyncio.Event) -> None:
        watchers = self._watchers.get(session_id)
        if watchers is not None:
            watchers.discard(event)
            if not watchers:
                del self._watchers[session_id]

    def notify(self, session_ids: Collection[str]) -> None:
        """Called from store threads after a commit."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake, tuple(session_ids))

    def _wake(self, session_ids: tuple[str, ...]) -> None:
        if "*" in session_ids:
            targets: list[set[asyncio.Event]] = list(self._watchers.values())
        else:
            targets = [self._watchers[s] for s in session_ids if s in self._watchers]
        for events in targets:
            for event in events:
                event.set()

    def wake_all(self) -> None:
        self._wake(("*",))


class LedgerServicer(pb_grpc.LedgerServiceServicer):
    def __init__(self, store: LedgerStore, waker: SessionWaker, settings: Settings) -> None:
        self._store = store
        self._waker = waker
        self._settings = settings
        self._draining = asyncio.Event()

    async def drain(self) -> None:
        """Ends every Subscribe stream cleanly (status OK)."""
        self._draining.set()
        self._waker.wake_all()

    @unary_errors
    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Context
    ) -> pb.CreateSessionResponse:
        session_id = F.check_id(request.session_id, "session_id")
        tenant_id = F.check_id(request.tenant_id, "tenant_id")
        created = await asyncio.to_thread(self._store.create_session, session_id, tenant_id)
        return pb.CreateSessionResponse(session_id=session_id, created=created)

    @unary_errors
    async def Append(self, request: pb.AppendRequest, context: Context) -> pb.AppendResponse:
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
        outcome = self._store.submit_async(session_id, new_facts, request.epoch)
        outcome.add_done_callback(
            note_refusal(session_id, request.epoch, [f.kind for f in new_facts])
        )
        outcome.add_done_callback(time_append(started))
        # Shielded: a caller that goes away does not cancel the outcome, so
        # the decision (already queued) is still seen and counted.
        results = await asyncio.shield(outcome)
        return pb.AppendResponse(
            results=[pb.AppendResult(seq=r.seq, duplicate=r.duplicate) for r in results],
            head_seq=max(r.seq for r in results),
        )

    @unary_errors
    async def Read(self, request: pb.ReadRequest, context: Context) -> pb.ReadResponse:
        session_id = F.check_id(request.session_id, "session_id")
        after = F.check_cursor(request.after_seq)
        limit = F.check_limit(request.limit)
        facts, head = await asyncio.to_thread(self._store.read_page, session_id, after, limit)
        return pb.ReadResponse(facts=[fact_to_pb(f) for f in facts], head_seq=head)

    @stream_errors
    async def Subscribe(
        self, request: pb.SubscribeRequest, context: Context
    ) -> AsyncIterator[pb.SubscribeResponse]:
        session_id = F.check_id(request.session_id, "session_id")
        cursor = F.check_cursor(request.after_seq)
        if not await asyncio.to_thread(self._store.exists, session_id):
            raise SessionNotFound(f"no session {session_id!r}")
        # Registered before the first read, so a commit between a read that
        # came back empty and the wait below still wakes us.
        woken = self._waker.watch(session_id)
        try:
            while not self._draining.is_set():
                woken.clear()
                facts = await asyncio.to_thread(
                    self._store.read, session_id, cursor, SUBSCRIBE_BATCH
                )
                for fact in facts:
                    yield pb.SubscribeResponse(fact=fact_to_pb(fact))
                    cursor = fact.seq
                if len(facts) == SUBSCRIBE_BATCH:
                    continue
                # A short page ended at the head: anything newer has set
                # `woken` (cleared before the read), so wait without reading.
                waits = [
                    asyncio.ensure_future(self._draining.wait()),
                    asyncio.ensure_future(woken.wait()),
                ]
                try:
                    await asyncio.wait(
                        waits, timeout=SAFETY_POLL_S, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    for waiting in waits:
                        waiting.cancel()
        finally:
            self._waker.unwatch(session_id, woken)

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
