"""Per session and per edge: one ledger subscription and one owner watch,
shared by every SSE client of that session.

Without it each browser tab would hold its own ledger stream (every commit
costing the ledger one read per client) and would ask the kernel for the
owner and open its own runner stream at every new epoch. With it, a commit
costs one read and one broadcast, whatever the number of clients.

Facts: a client joins the live broadcast first, then reads its backlog from
the ledger up to where the broadcast began, so there is neither a gap nor a
repeat at the seam (facts at or below the client's cursor are skipped; a gap
in the broadcast, which a slow consumer can cause, is filled from the ledger).

Partials (`Partial`, `StatusChange`) come from the session's owner. The watch
re-attaches whenever an `epoch_started` fact shows that the owner changed;
the fact names the owner's runtime, so the kernel is asked only when a
client joins mid-attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeAlias

from services.common.errors import KeelError
from services.ledger import CommittedFact, LedgerClient
from services.runner.client import RunnerClient
from services.runner.hub import Partial, StatusChange

log = logging.getLogger("keel.edge.fanout")
CLIENT_BUFFER = 1024
_CLOSED = object()
IDLE = StatusChange("idle", 0)


class Inbox:
    """What one client has not been sent yet: bounded, with one reader.

    A broadcast touches every client of a session, so this is kept leaner
    than asyncio.Queue (no task accounting, no getter queue): an append, and
    a wake-up only when the reader is waiting.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: object) -> bool:
        """False (and the item dropped) when the client is CLIENT_BUFFER behind."""
        if len(self._items) >= CLIENT_BUFFER:
            return False
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    def put_never_dropped(self, item: object) -> None:
        """Makes room, if need be, by dropping the oldest items (the client
        resumes from its cursor anyway)."""
        while len(self._items) >= CLIENT_BUFFER:
            self._items.popleft()
        self.put(item)

    async def take_all(self) -> list[object]:
        """Everything pending, waiting for at least one item."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


class Drain:
    """This edge is draining: the client should reconnect (here or elsewhere)."""


DRAIN = Drain()
Live: TypeAlias = CommittedFact | Partial | StatusChange | Drain
# session id -> its owner's runner; runtime id -> that runtime's runner.
OwnerLookup = Callable[[str], Awaitable[RunnerClient | None]]
RunnerLookup = Callable[[str], Awaitable[RunnerClient | None]]


class SessionFanout:
    def __init__(self, hub: FanoutHub, session_id: str) -> None:
        self._hub = hub
        self._session_id = session_id
        self._clients: set[Inbox] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._owner_changed = asyncio.Event()
        # The runtime named by the latest epoch_started not yet attached to.
        self._owner_hint = ""
        self.status: StatusChange = IDLE

    def join(self) -> Inbox:
        inbox = Inbox()
        self._clients.add(inbox)
        if not self._tasks:
            self._owner_changed.set()
            self._tasks = [
                asyncio.create_task(self._follow_facts(), name=f"fanout-{self._session_id}"),
                asyncio.create_task(self._follow_owner(), name=f"owner-{self._session_id}"),
            ]
        return inbox

    def leave(self, inbox: Inbox) -> None:
        self._clients.discard(inbox)
        if not self._clients:
            for task in self._tasks:
                task.cancel()
            self._tasks = []
            self._hub.forget(self._session_id, self)

    def broadcast_drain(self) -> None:
        for inbox in list(self._clients):
            inbox.put_never_dropped(DRAIN)

    def _broadcast(self, item: object) -> None:
        # A full inbox drops the item for that client only; for a fact it
        # notices the gap and reads it from the ledger.
        for inbox in list(self._clients):
            inbox.put(item)

    async def _follow_facts(self) -> None:
        ledger = self._hub.ledger
        try:
            head = (await ledger.get_session(self._session_id)).head_seq
            async for fact in ledger.subscribe(self._session_id, head):
                self._broadcast(fact)
                if fact.kind == "epoch_started":
                    self._owner_hint = str(fact.data.get("runtimeId") or "")
                    self._owner_changed.set()
        except KeelError as error:
            log.info("fan-out of %s ended: %s", self._session_id, error)
        finally:
            self._broadcast(_CLOSED)

    async def _follow_owner(self) -> None:
        while True:
            await self._owner_changed.wait()
            self._owner_changed.clear()
            hint, self._owner_hint = self._owner_hint, ""
            if hint:
                runner = await self._hub.runner_of(hint)
            else:
                runner = await self._hub.owner_of(self._session_id)
            if runner is None:
                continue
            with contextlib.suppress(KeelError):
                async for event in runner.watch(self._session_id):
                    if isinstance(event, StatusChange):
                        self.status = event
                    self._broadcast(event)
            if self.status != IDLE:
                self.status = IDLE
                self._broadcast(IDLE)


class FanoutHub:
    def __init__(
        self, ledger: LedgerClient, owner_of: OwnerLookup, runner_of: RunnerLookup
    ) -> None:
        self.ledger = ledger
        self.owner_of = owner_of
        self.runner_of = runner_of
        self.draining = False
        self._sessions: dict[str, SessionFanout] = {}

    def forget(self, session_id: str, fanout: SessionFanout) -> None:
        if self._sessions.get(session_id) is fanout:
            del self._sessions[session_id]

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def drain(self) -> None:
        """Tells every client of this edge to reconnect."""
        self.draining = True
        for fanout in list(self._sessions.values()):
            fanout.broadcast_drain()

    async def follow(self, session_id: str, after: int) -> AsyncGenerator[list[Live], None]:
        """Facts with seq > after in order (backlog, then live), interleaved
        with the owner's partials once the backlog is out, in batches: all a
        client has pending goes out in one write. Ends after DRAIN, or when
        the ledger stream ends."""
        fanout = self._sessions.get(session_id)
        if fanout is None:
            fanout = self._sessions[session_id] = SessionFanout(self, session_id)
        inbox = fanout.join()
        cursor = after
        try:
            if self.draining:
                yield [DRAIN]
                return
            async for page in _catch_up_facts(self.ledger, session_id, cursor):
                yield list(page)
                cursor = page[-1].seq
            if fanout.status != IDLE:
                # Whoever works on the session now, as far as this edge knows.
                yield [fanout.status]
            while True:
                batch: list[Live] = []
                for item in await inbox.take_all():
                    if item is _CLOSED or item is DRAIN:
                        if item is DRAIN:
                            batch.append(DRAIN)
                        if batch:
                            yield batch
                        return
                    if not isinstance(item, CommittedFact):
                        assert isinstance(item, Partial | StatusChange)
                        batch.append(item)
                        continue
                    if item.seq > cursor + 1:
                        # Facts this client missed: read them (and this one) back.
                        async for page in _catch_up_facts(self.ledger, session_id, cursor):
                            batch.extend(page)
                            cursor = page[-1].seq
                    if item.seq <= cursor:
                        continue
                    batch.append(item)
                    cursor = item.seq
                if batch:
                    yield batch
        finally:
            fanout.leave(inbox)


async def _catch_up_facts(
    ledger: LedgerClient, session_id: str, cursor: int
) -> AsyncIterator[list[CommittedFact]]:
    """Pages of the facts after `cursor` from the ledger, up to its head."""
    while True:
        page, head = await ledger.read(session_id, cursor, 500)
        if page:
            yield page
            cursor = page[-1].seq
        if not page or cursor >= head:
            return
