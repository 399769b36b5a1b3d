"""Per session and per edge: one ledger subscription and one watch of the
session's runner, shared by every client of that session.

Without it each browser tab would hold its own ledger stream (every commit
costing the ledger one read per client) and would ask the kernel for the
owner and open its own runner stream at every new epoch. With it, a commit
costs one read and one broadcast, whatever the number of clients.

Per session, three parts, each in its place:

- `SessionFanout` (here) runs the two sources: the ledger subscription and
  the watch of the attempt at work, each feeding the session's merge.
- `SessionMerge` (edge/fanout_merge.py) puts them in the one order every
  client sees: each delta before the facts committed after it, whatever the
  timing of the two streams, and decides which attempt to watch.
- Each client (edge/fanout_clients.py) gets what the merge emits from the
  point it joined: `follow_frames` (here) sends its backlog from the ledger
  first, then the broadcast, with no gap nor repeat at the seam (facts at or
  below the client's cursor are skipped; a gap in the broadcast, which a
  slow consumer can cause, is filled from the ledger), and skips partials a
  client's own history makes stale (`Shown`: a client that joins
  mid-attempt may read an answer in its backlog before the watch replays
  that answer's deltas).

The kernel is asked for the owner only once the subscription has fixed the
head it starts after: an owner looked up before a takeover whose
`epoch_started` is at or below that head would be followed for good (no live
fact would name the successor).

Each item is broadcast as one `Frame` (edge/frames.py) shared by every
client, so it is encoded once per front door. A client whose backlog is out
and who waits for more with nothing pending is *parked*: if it gave a
`DirectSink` (an SSE connection), the broadcast writes the frame to it at
once, in the broadcasting task, so a thousand such clients cost one wake-up
per item, not a thousand. Anything else - a client still catching up, a gap
to fill from the ledger, a connection whose send buffer is full (a slow
client), a gRPC stream - goes through the client's bounded inbox and its
own task: an inbox CLIENT_BUFFER behind drops the item, and a dropped fact
is read back from the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeAlias, cast

from edge import metrics as edge_metrics
from edge.fanout_clients import Client, DirectSink
from edge.fanout_merge import Attempt, Merged, SessionMerge
from edge.frames import Frame, WireCodec
from services.common.errors import KeelError
from services.ledger import CommittedFact, LedgerClient
from services.runner.client import RunnerClient
from services.runner.events import IDLE, Partial, StatusChange

log = logging.getLogger(__name__)
_CLOSED = object()


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
        self._clients: set[Client] = set()
        self._merge = SessionMerge(self._broadcast, self._start_watch)
        self._follow: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        # Set once the ledger stream is over or the last client left: no
        # watch starts any more.
        self._closed = False
        # The seq the ledger subscription starts after: a client's backlog
        # must reach at least this far, or the facts between its own read of
        # the head and the subscription's would reach it only with a later
        # fact (and never, if none comes).
        self._subscribed_after: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def clients(self) -> int:
        return len(self._clients)

    @property
    def status(self) -> StatusChange:
        """Whoever works on the session now, as far as this edge knows."""
        return self._merge.status

    def join(self, cursor: int, sink: DirectSink | None) -> Client:
        client = Client(cursor, sink)
        self._clients.add(client)
        if self._follow is None:
            self._follow = asyncio.create_task(
                self._follow_facts(), name=f"fanout-{self._session_id}"
            )
        return client

    def leave(self, client: Client) -> None:
        self._clients.discard(client)
        if not self._clients:
            self._stop_watching()
            if self._follow is not None:
                self._follow.cancel()
            self._hub.forget(self._session_id, self)

    def _stop_watching(self) -> None:
        self._closed = True
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None

    def broadcast_drain(self) -> None:
        for client in list(self._clients):
            client.put_never_dropped(DRAIN)

    def _broadcast(self, item: Merged) -> None:
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

    async def subscribed_after(self) -> int:
        """The seq the live broadcast starts after (see __init__)."""
        return await asyncio.shield(self._subscribed_after)

    # -- the ledger's facts --

    async def _follow_facts(self) -> None:
        ledger = self._hub.ledger
        try:
            head = (await ledger.get_session(self._session_id)).head_seq
            self._subscribed_after.set_result(head)
            # Every epoch_started at or below the head was committed after
            # its claim: the kernel, asked from now on, names that attempt's
            # owner or a newer one (whose fact comes live).
            self._merge.watch_owner()
            async for fact in ledger.subscribe(self._session_id, head):
                self._merge.fact(fact)
        except KeelError as error:
            log.info("fan-out of %s ended: %s", self._session_id, error)
        finally:
            if not self._subscribed_after.done():
                self._subscribed_after.set_result(0)
            self._stop_watching()
            self._merge.close()
            self._close_all()
            # A client that joins from now on gets a fan-out of its own: this
            # one follows nothing any more.
            self._hub.forget(self._session_id, self)

    # -- the runner's partials --

    def _start_watch(self, watch: int, attempt: Attempt | None) -> None:
        """Watch number `watch` replaces the one running (the merge ignores
        what an older one still relays)."""
        if self._closed:
            return
        if self._watching is not None:
            self._watching.cancel()
        self._watching = asyncio.create_task(
            self._watch(watch, attempt), name=f"watch-{self._session_id}"
        )

    async def _watch(self, watch: int, attempt: Attempt | None) -> None:
        """Relays one watch of the attempt's (or the owner's) partials and
        marks to the merge until it ends or fails."""
        epoch, attempt_id = (attempt.epoch, attempt.attempt_id) if attempt else (0, "")
        try:
            if attempt is not None and attempt.runtime_id:
                runner = await self._hub.runner_of(attempt.runtime_id)
            else:
                runner = await self._hub.owner_of(self._session_id)
            if runner is not None:
                async for event in runner.watch(self._session_id, epoch, attempt_id):
                    self._merge.watch_event(watch, event)
        except KeelError as error:
            log.debug("watch of %s ended: %s", self._session_id, error)
        except Exception:  # a bug must not silently stop the session's partials
            log.exception("watch of %s failed", self._session_id)
        self._merge.watch_ended(watch)


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
            if fanout.status.state != IDLE and not shown.outdated(fanout.status):
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
