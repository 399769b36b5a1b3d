"""One client of a session's fan-out (edge/fanout.py): what it has not been
sent yet, what it has been sent (which decides what it is sent next), and,
for an SSE stream, the connection the broadcast may write to itself.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol, runtime_checkable

from edge.frames import Frame
from services.ledger import CommittedFact
from services.ledger.facts import ASSISTANT, EPOCH_STARTED
from services.runner.events import Partial, StatusChange

# Items a client may be behind before the next one is dropped for it (a
# dropped fact is read back from the ledger; a dropped partial is lost).
CLIENT_BUFFER = 1024
# Per client: answered generations remembered to drop their late deltas.
ANSWERED_GENERATIONS = 64


def attempt_epoch(fact: CommittedFact) -> int:
    """The epoch an `epoch_started` fact starts."""
    epoch = fact.data.get("epoch")
    return epoch if isinstance(epoch, int) and epoch > 0 else fact.epoch


@runtime_checkable
class DirectSink(Protocol):
    """A client connection the broadcast may write a frame to by itself."""

    def write(self, data: bytes) -> bool:
        """Writes `data` now; False (nothing written) when the connection is
        closing or its send buffer is full (a slow client)."""
        ...


class Client:
    """One client of a session: what it has not been sent yet (bounded, with
    one reader), and what it has been sent that decides what comes next.

    A broadcast touches every client of a session, so this is kept leaner
    than asyncio.Queue (no task accounting, no getter queue): an append, and
    a wake-up only when the reader is waiting.
    """

    __slots__ = ("_items", "_parked", "_waiter", "cursor", "shown", "sink")

    def __init__(self, cursor: int, sink: DirectSink | None) -> None:
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # The reader waits with nothing pending and everything it took
        # written: a frame may go straight to its sink.
        self._parked = False
        self.cursor = cursor  # the seq of the last fact sent
        self.shown = Shown()
        self.sink = sink

    def offer(self, frame: Frame) -> int:
        """Writes `frame` to the sink of a parked client (returns 1: one
        frame written), or queues it for the client's reader (returns 0), as
        `put` does."""
        sink = self.sink if self._parked else None
        if sink is not None:
            item = frame.item
            if isinstance(item, CommittedFact):
                if item.seq <= self.cursor:
                    return 0  # sent already (from the client's backlog)
                # A gap (seq > cursor + 1) is the reader's to fill.
                if item.seq == self.cursor + 1:
                    data = frame.sse
                    if data is None or sink.write(data):
                        self.cursor = item.seq
                        self.shown.note(item)
                        return 1 if data is not None else 0
            elif isinstance(item, (Partial, StatusChange)):
                if self.shown.outdated(item):
                    return 0
                data = frame.sse
                if data is None:
                    return 0
                if sink.write(data):
                    return 1
        self.put(frame)
        return 0

    def put(self, item: object) -> bool:
        """False (and the item dropped) when the client is CLIENT_BUFFER behind."""
        # From now on the reader has something to send first: no frame may
        # overtake it on the sink.
        self._parked = False
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
        """Everything pending, waiting for at least one item (parked)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            self._parked = True
            try:
                await self._waiter
            finally:
                self._waiter = None
                self._parked = False
        items = list(self._items)
        self._items.clear()
        return items


class Shown:
    """What one client has been sent that later partials must agree with.

    The generations whose assistant fact it has (the latest few): a delta of
    such a generation, replayed by a watch that began after the answer (the
    client read it in its backlog; live deltas come before their answer, see
    edge/fanout_merge.py), would start a preview that no fact ever ends. And
    the newest epoch whose epoch_started it has: a delta or status of an
    older epoch comes from an owner that was taken over (the watch of
    it ends, but what it relayed meanwhile is still queued), and would show a
    superseded attempt as running after its successor began.
    """

    __slots__ = ("_epoch", "_ids")

    def __init__(self) -> None:
        self._ids: dict[str, None] = {}
        self._epoch = 0

    def outdated(self, item: Partial | StatusChange) -> bool:
        if isinstance(item, Partial):
            return item.epoch < self._epoch or item.generation_id in self._ids
        # An idle status (epoch 0) is the edge's own: the watch ended.
        return 0 < item.epoch < self._epoch

    def note(self, fact: CommittedFact) -> None:
        if fact.kind == EPOCH_STARTED:
            self._epoch = max(self._epoch, attempt_epoch(fact))
            return
        if fact.kind != ASSISTANT:
            return
        generation_id = fact.data.get("generationId")
        if isinstance(generation_id, str) and generation_id not in self._ids:
            self._ids[generation_id] = None
            if len(self._ids) > ANSWERED_GENERATIONS:
                del self._ids[next(iter(self._ids))]

    def note_all(self, facts: list[CommittedFact]) -> None:
        for fact in facts:
            if fact.kind in (ASSISTANT, EPOCH_STARTED):
                self.note(fact)
