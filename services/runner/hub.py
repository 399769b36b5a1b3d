"""Token-level partials and session status, in memory only.

Partials are never facts: a crash loses them by design, and a client that
reconnects gets the committed answer from the ledger instead. The hub fans
them out to `WatchSession` streams (the edge) while this runner owns the
session.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, TypeAlias

State: TypeAlias = Literal["idle", "running", "compacting"]
WATCH_BUFFER = 1024


@dataclass(frozen=True)
class Partial:
    generation_id: str
    channel: Literal["text", "thinking", "tool_call"]
    text: str


@dataclass(frozen=True)
class StatusChange:
    state: State
    epoch: int


HubEvent: TypeAlias = Partial | StatusChange
_END = object()


class PartialHub:
    def __init__(self) -> None:
        self._watchers: defaultdict[str, set[asyncio.Queue[object]]] = defaultdict(set)
        self._status: dict[str, StatusChange] = {}

    def owns(self, session_id: str) -> bool:
        return session_id in self._status

    def status(self, session_id: str) -> StatusChange | None:
        return self._status.get(session_id)

    def publish(self, session_id: str, event: HubEvent) -> None:
        if isinstance(event, StatusChange):
            self._status[session_id] = event
        for queue in self._watchers.get(session_id, ()):
            if queue.qsize() < WATCH_BUFFER:  # a stalled watcher loses partials, never facts
                queue.put_nowait(event)

    def release(self, session_id: str) -> None:
        """This runner stopped owning the session: end its watch streams."""
        self._status.pop(session_id, None)
        for queue in self._watchers.get(session_id, ()):
            queue.put_nowait(_END)

    def close_all(self) -> None:
        for session_id in list(self._watchers):
            self.release(session_id)

    async def watch(self, session_id: str) -> AsyncIterator[HubEvent]:
        """Current status first, then live events, until ownership ends."""
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._watchers[session_id].add(queue)
        try:
            current = self._status.get(session_id)
            if current is None:
                return
            yield current
            while True:
                item = await queue.get()
                if item is _END:
                    return
                assert isinstance(item, Partial | StatusChange)
                yield item
        finally:
            watchers = self._watchers.get(session_id)
            if watchers is not None:
                watchers.discard(queue)
                if not watchers:
                    del self._watchers[session_id]
