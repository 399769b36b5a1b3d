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

Partials (`Partial`, `StatusChange`) come from the runner of the attempt. An
`epoch_started` fact names the attempt and its runtime, and the watch
attaches to exactly that attempt. The kernel is asked only when a client
joins mid-attempt, and only once the subscription has fixed the head it
starts after: an owner looked up before a takeover whose `epoch_started` is
at or below that head would be followed for good (no live fact would name
the successor), and a frozen owner would keep its clients from every delta
of the new epoch. The runner replays what the attempt streamed before the
watch began - with an instant model that is all of it - and marks where the
replay ends. Until then the facts after that `epoch_started` are held back
(in order, at most HOLD_S and HOLD_FACTS), so a client sees an attempt's
deltas before the answer they preview, as it would from a slower model. A
newer attempt ends the watch of the older one at once.

Each client also drops deltas of a generation whose assistant fact it has
been sent (a late delta would start a preview no fact ever ends), and deltas
and statuses of an epoch older than the newest `epoch_started` it has been
sent: an owner that was taken over (a frozen process resumed, a partitioned
one) may still stream for a moment, and its backlog may show a client the
takeover before the fan-out's own subscription does.

Each item is broadcast as one `Frame` (edge/frames.py) shared by every
client, so it is encoded once per front door. A client whose backlog is out
and who waits for more with nothing pending is *parked*: if it gave a
`DirectSink` (an SSE connection), the broadcast writes the frame to it at
once, in the broadcasting task, so a thousand such clients cost one wake-up
per item, not a thousand. Anything else - a client still catching up, a gap
to fill from the ledger, a connection whose send buffer is full (a slow
client), a gRPC stream - goes through the client's bounded inbox and its
own task, under the same rules as before: an inbox CLIENT_BUFFER behind
drops the item, and a dropped fact is read back from the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeAlias, cast

from edge import metrics as edge_metrics
from edge.fanout_clients import Client, DirectSink, attempt_epoch
from edge.frames import Frame, WireCodec
from services.common.errors import KeelError
from services.ledger import CommittedFact, LedgerClient
from services.runner.client import RunnerClient
from services.runner.hub import Partial, ReplayEnd, StatusChange

log = logging.getLogger("keel.edge.fanout")
# An attempt's facts wait for the replay of its partials at most this long,
# and at most this many (past either, they go out: facts are never late for
# the sake of a preview by more than that).
HOLD_S = 2.0
HOLD_FACTS = 256
_CLOSED = object()
IDLE = StatusChange("idle", 0)


class Drain:
    """This edge is draining: the client should reconnect (here or elsewhere)."""


DRAIN = Drain()
Live: TypeAlias = CommittedFact | Partial | StatusChange | Drain
# session id -> its owner's runner; runtime id -> that runtime's runner.
OwnerLookup = Callable[[str], Awaitable[RunnerClient | None]]
RunnerLookup = Callable[[str], Awaitable[RunnerClient | None]]


@dataclass(frozen=True)
class _Attempt:
    """An attempt as its epoch_started fact names it."""

    runtime_id: str
    epoch: int
    attempt_id: str

    @classmethod
    def of(cls, fact: CommittedFact) -> _Attempt:
        data = fact.data
        return cls(
            runtime_id=str(data.get("runtimeId") or ""),
            epoch=attempt_epoch(fact),
            attempt_id=str(data.get("attemptId") or ""),
        )


class SessionFanout:
    def __init__(self, hub: FanoutHub, session_id: str) -> None:
        self._hub = hub
        self._session_id = session_id
        self._clients: set[Client] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._owner_changed = asyncio.Event()
        # The attempt named by the latest epoch_started not yet attached to
        # (None: ask the kernel who owns the session).
        self._next: _Attempt | None = None
        # The epoch the current watch follows (from its first status), and
        # the same once its replay is through.
        self._watch_epoch = 0
        self._live_epoch = 0
        # Facts waiting for the replay of this epoch's partials (0: none).
        self._holding = 0
        self._held: deque[CommittedFact] = deque()
        self._hold_timer: asyncio.TimerHandle | None = None
        self.status: StatusChange = IDLE
        # The seq the ledger subscription starts after: a client's backlog
        # must reach at least this far, or the facts between its own read of
        # the head and the subscription's would reach it only with a later
        # fact (and never, if none comes).
        self._subscribed_after: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def clients(self) -> int:
        return len(self._clients)

    def join(self, cursor: int, sink: DirectSink | None) -> Client:
        client = Client(cursor, sink)
        self._clients.add(client)
        if not self._tasks:
            self._owner_changed.set()
            self._tasks = [
                asyncio.create_task(self._follow_facts(), name=f"fanout-{self._session_id}"),
                asyncio.create_task(self._follow_owner(), name=f"owner-{self._session_id}"),
            ]
        return client

    def leave(self, client: Client) -> None:
        self._clients.discard(client)
        if not self._clients:
            for task in self._tasks:
                task.cancel()
            self._tasks = []
            self._hub.forget(self._session_id, self)

    def broadcast_drain(self) -> None:
        for client in list(self._clients):
            client.put_never_dropped(DRAIN)

    def _broadcast(self, item: object) -> None:
        # One frame for every client (encoded at most once per front door).
        # A full inbox drops it for that client only; for a fact it notices
        # the gap and reads it from the ledger.
        frame = Frame(item, self._hub.codec)
        written = 0
        for client in list(self._clients):
            written += client.offer(frame)
        edge_metrics.sse_frames_sent(written)

    def _close_all(self) -> None:
        for client in list(self._clients):
            client.put(_CLOSED)

    # -- facts --

    async def _follow_facts(self) -> None:
        ledger = self._hub.ledger
        try:
            head = (await ledger.get_session(self._session_id)).head_seq
            self._subscribed_after.set_result(head)
            async for fact in ledger.subscribe(self._session_id, head):
                self._deliver(fact)
        except KeelError as error:
            log.info("fan-out of %s ended: %s", self._session_id, error)
        finally:
            if not self._subscribed_after.done():
                self._subscribed_after.set_result(0)
            self._stop_holding()
            while self._held:
                self._broadcast(self._held.popleft())
            self._close_all()
            # A client that joins from now on gets a fan-out of its own: this
            # one follows nothing any more.
            self._hub.forget(self._session_id, self)

    async def subscribed_after(self) -> int:
        """The seq the live broadcast starts after (see __init__)."""
        return await asyncio.shield(self._subscribed_after)

    def _deliver(self, fact: CommittedFact) -> None:
        """Broadcasts a fact, or holds it (and every later one, keeping the
        order) while an attempt's replay is due."""
        if self._holding:
            self._held.append(fact)
            if len(self._held) >= HOLD_FACTS:
                self._end_hold(self._holding)
            return
        self._broadcast(fact)
        if fact.kind == "epoch_started":
            self._attach(_Attempt.of(fact))

    def _attach(self, attempt: _Attempt) -> None:
        if attempt.epoch and attempt.epoch == self._watch_epoch:
            # The watch opened at join already follows this attempt: no second
            # replay (it would send the client every delta twice).
            if self._live_epoch != attempt.epoch:
                self._hold(attempt.epoch)
            return
        self._next = attempt
        self._owner_changed.set()
        if attempt.runtime_id:
            self._hold(attempt.epoch)

    def _hold(self, epoch: int) -> None:
        self._holding = epoch
        self._hold_timer = asyncio.get_running_loop().call_later(HOLD_S, self._end_hold, epoch)

    def _stop_holding(self) -> None:
        self._holding = 0
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None

    def _end_hold(self, epoch: int) -> None:
        """The attempt's replay is through (or will never come): the facts
        held for it go out, up to the next epoch_started, which may hold the
        rest for its own attempt."""
        if not epoch or epoch != self._holding:
            return
        self._stop_holding()
        while self._held and not self._holding:
            self._deliver(self._held.popleft())

    # -- partials --

    async def _follow_owner(self) -> None:
        # Every epoch_started at or below the subscription's head was
        # committed after its claim: the kernel, asked from now on, names
        # that attempt's owner or a newer one (whose fact comes live).
        await self.subscribed_after()
        while True:
            await self._owner_changed.wait()
            self._owner_changed.clear()
            attempt, self._next = self._next, None
            watching = asyncio.create_task(self._watch(attempt))
            changed = asyncio.create_task(self._owner_changed.wait())
            try:
                # A newer attempt started: the one watched is over, and a
                # stuck stream (a partitioned runner) must not keep the
                # client from the new one.
                await asyncio.wait({watching, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (watching, changed):
                    task.cancel()
                await asyncio.gather(watching, changed, return_exceptions=True)
                watched, self._watch_epoch, self._live_epoch = self._watch_epoch, 0, 0
                # Whatever the watch did not replay will not come from it.
                self._end_hold(watched)
                if attempt is not None:
                    self._end_hold(attempt.epoch)
            if not self._owner_changed.is_set() and self.status.state != "idle":
                self.status = IDLE
                self._broadcast(IDLE)

    async def _watch(self, attempt: _Attempt | None) -> None:
        """Relays one watch of the owner's partials until it ends or fails."""
        epoch, attempt_id = (attempt.epoch, attempt.attempt_id) if attempt else (0, "")
        try:
            if attempt is not None and attempt.runtime_id:
                runner = await self._hub.runner_of(attempt.runtime_id)
            else:
                runner = await self._hub.owner_of(self._session_id)
            if runner is None:
                return
            async for event in runner.watch(self._session_id, epoch, attempt_id):
                if isinstance(event, ReplayEnd):
                    self._live_epoch = self._watch_epoch
                    self._end_hold(self._watch_epoch)
                    continue
                if isinstance(event, StatusChange):
                    self._watch_epoch = self._watch_epoch or event.epoch
                    self.status = event
                self._broadcast(event)
        except KeelError as error:
            log.debug("watch of %s ended: %s", self._session_id, error)
        except Exception:  # a bug must not silently stop the session's partials
            log.exception("watch of %s failed", self._session_id)


class FanoutHub:
    def __init__(
        self, ledger: LedgerClient, owner_of: OwnerLookup, runner_of: RunnerLookup
    ) -> None:
        self.ledger = ledger
        self.owner_of = owner_of
        self.runner_of = runner_of
        self.draining = False
        self._sessions: dict[str, SessionFanout] = {}
        # What turns broadcast items into bytes (one per hub, so every client
        # of a session shares a frame's encodings).
        self.codec = WireCodec()

    def forget(self, session_id: str, fanout: SessionFanout) -> None:
        if self._sessions.get(session_id) is fanout:
            del self._sessions[session_id]

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def clients(self) -> int:
        """Clients of every session: none once every stream closed."""
        return sum(fanout.clients for fanout in self._sessions.values())

    def drain(self) -> None:
        """Tells every client of this edge to reconnect."""
        self.draining = True
        for fanout in list(self._sessions.values()):
            fanout.broadcast_drain()

    async def follow(self, session_id: str, after: int) -> AsyncGenerator[list[Live], None]:
        """The items of `follow_frames`, without their encodings."""
        async with contextlib.aclosing(self.follow_frames(session_id, after)) as batches:
            async for batch in batches:
                yield [cast(Live, frame.item) for frame in batch]

    async def follow_frames(
        self, session_id: str, after: int, sink: DirectSink | None = None
    ) -> AsyncGenerator[list[Frame], None]:
        """Facts with seq > after in order (backlog, then live), interleaved
        with the owner's partials once the backlog is out, in batches: all a
        client has pending goes out in one write. Ends after DRAIN (the last
        frame's item), or when the ledger stream ends.

        With a `sink`, whatever comes while the caller waits for the next
        batch with nothing pending may be written to the sink instead
        (see `Client.offer`): the caller must have written every batch it
        was given before it asks for the next one."""
        fanout = self._sessions.get(session_id)
        if fanout is None:
            fanout = self._sessions[session_id] = SessionFanout(self, session_id)
        client = fanout.join(after, sink)
        shown = client.shown
        try:
            if self.draining:
                yield [Frame(DRAIN, self.codec)]
                return
            async for page in _catch_up_facts(self.ledger, session_id, client.cursor):
                shown.note_all(page)
                client.cursor = page[-1].seq
                yield self._frames(page)
            if await fanout.subscribed_after() > client.cursor:
                # Committed between this client's read and the subscription's.
                async for page in _catch_up_facts(self.ledger, session_id, client.cursor):
                    shown.note_all(page)
                    client.cursor = page[-1].seq
                    yield self._frames(page)
            if fanout.status.state != "idle" and not shown.outdated(fanout.status):
                # Whoever works on the session now, as far as this edge knows.
                yield [Frame(fanout.status, self.codec)]
            while True:
                batch: list[Frame] = []
                for entry in await client.take_all():
                    if entry is _CLOSED or entry is DRAIN:
                        if entry is DRAIN:
                            batch.append(Frame(DRAIN, self.codec))
                        if batch:
                            yield batch
                        return
                    assert isinstance(entry, Frame)
                    item = entry.item
                    if isinstance(item, (Partial, StatusChange)):
                        if not shown.outdated(item):
                            batch.append(entry)
                        continue
                    assert isinstance(item, CommittedFact)
                    if item.seq > client.cursor + 1:
                        # Facts this client missed: read them (and this one) back.
                        async for page in _catch_up_facts(self.ledger, session_id, client.cursor):
                            shown.note_all(page)
                            batch.extend(self._frames(page))
                            client.cursor = page[-1].seq
                    if item.seq <= client.cursor:
                        continue
                    shown.note(item)
                    batch.append(entry)
                    client.cursor = item.seq
                if batch:
                    yield batch
        finally:
            fanout.leave(client)

    def _frames(self, facts: list[CommittedFact]) -> list[Frame]:
        """A client's own facts (its backlog, a gap): frames of its own."""
        return [Frame(fact, self.codec) for fact in facts]


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
