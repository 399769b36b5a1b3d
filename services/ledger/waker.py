"""`SessionWaker`: wakes a session's subscribers when it commits, and hands
them what this ledger just committed.

A subscriber follows a live session. Reading the database after every
commit to find the facts this very process has just written cost a thread
hop, a query and a decode per fact per subscriber (a sixth of a turn's CPU).
So the writer hands its committed facts here, encoded once, and a subscriber
whose cursor is where they begin takes them from memory. Anything else
reaches a subscriber as a bare wake-up that makes it read the database:
another ledger process's commit (its NOTIFY), a session's creation, a gap,
a window that has moved past the cursor. Missing a fact is impossible by
construction: the window only ever answers "the facts right after your
cursor", contiguous, or "go and read".
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keel.ledger.v1 import ledger_pb2 as pb
from services.ledger.codec import fact_to_pb
from services.ledger.domain import to_committed

# Facts kept per watched session: a subscriber further behind than this
# (slow, or just started) reads the database as before.
WINDOW = 256


@dataclass(eq=False)
class Watch:
    """One subscriber's wake-up, and whether only the database can tell it
    what happened (a wake-up that carried no facts)."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    must_read: bool = True


class SessionWaker:
    """Wakes the subscribers of sessions that just committed (thread-safe)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchers: dict[str, set[Watch]] = {}
        # Recently committed facts of watched sessions, contiguous by seq,
        # each encoded once for all its subscribers. Touched on the loop only.
        self._recent: dict[str, list[pb.SubscribeResponse]] = {}

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def watch(self, session_id: str) -> Watch:
        watch = Watch()
        self._watchers.setdefault(session_id, set()).add(watch)
        return watch

    def unwatch(self, session_id: str, watch: Watch) -> None:
        watchers = self._watchers.get(session_id)
        if watchers is not None:
            watchers.discard(watch)
            if not watchers:
                del self._watchers[session_id]
                self._recent.pop(session_id, None)

    def after(self, session_id: str, cursor: int) -> list[pb.SubscribeResponse] | None:
        """The committed facts right after `cursor` that this ledger wrote,
        or None when memory cannot say (read the database)."""
        recent = self._recent.get(session_id)
        if not recent or recent[0].fact.seq > cursor + 1:
            return None
        return recent[cursor + 1 - recent[0].fact.seq :]

    # -- from store threads --

    def notify(self, session_ids: Collection[str]) -> None:
        """A commit known only by its sessions' ids: subscribers read.

        Skips waking the loop when nobody watches those sessions (most
        commits, on a ledger whose subscribers are elsewhere). Safe without
        a lock: a subscriber registers before its first read, so one that
        registers after this check reads after the commit, and finds it."""
        if self._should_wake(session_ids):
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._wake, tuple(session_ids))

    def committed(self, events: Mapping[str, Sequence[Any]]) -> None:
        """This ledger's writer committed these domain events, by session,
        in seq order: watched sessions' subscribers get them from memory."""
        if not self._should_wake(events):
            return
        watched = self._watchers
        # Encoded here, on the writer's thread, once whatever the number of
        # subscribers; only for sessions someone follows.
        facts = {
            session_id: [
                pb.SubscribeResponse(fact=fact_to_pb(to_committed(session_id, event)))
                for event in session_events
            ]
            for session_id, session_events in events.items()
            if session_id in watched
        }
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._keep, facts)

    def _should_wake(self, session_ids: Collection[str]) -> bool:
        if self._loop is None or self._loop.is_closed():
            return False
        watched = self._watchers
        return bool(watched) and ("*" in session_ids or any(s in watched for s in session_ids))

    # -- on the loop --

    def _keep(self, facts: dict[str, list[pb.SubscribeResponse]]) -> None:
        for session_id, new in facts.items():
            watchers = self._watchers.get(session_id)
            if not watchers or not new:
                continue
            recent = self._recent.get(session_id)
            if recent and recent[-1].fact.seq + 1 == new[0].fact.seq:
                recent.extend(new)
                del recent[:-WINDOW]
            else:
                # A gap (another writer, a commit redone alone): start afresh;
                # a subscriber whose cursor is before it reads the database.
                self._recent[session_id] = new[-WINDOW:]
            for watch in watchers:
                watch.event.set()

    def _wake(self, session_ids: tuple[str, ...]) -> None:
        if "*" in session_ids:
            targets: list[set[Watch]] = list(self._watchers.values())
        else:
            targets = [self._watchers[s] for s in session_ids if s in self._watchers]
        for watches in targets:
            for watch in watches:
                watch.must_read = True
                watch.event.set()

    def wake_all(self) -> None:
        self._wake(("*",))
