"""One ledger subscription per session per edge, shared by its SSE clients.

Without it, every browser tab would hold its own ledger stream and every
commit would cost the ledger one read per client. A client joins the live
broadcast first and then reads its backlog from the ledger up to where the
broadcast began, so there is neither a gap nor a repeat at the seam (facts
at or below the client's cursor are skipped; a gap in the broadcast, which a
slow consumer can cause, is filled from the ledger).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from services.common.errors import KeelError
from services.ledger import CommittedFact, LedgerClient

log = logging.getLogger("keel.edge.fanout")
CLIENT_BUFFER = 1024
_CLOSED = object()


class SessionFanout:
    def __init__(self, ledger: LedgerClient, session_id: str, on_idle: FanoutHub) -> None:
        self._ledger = ledger
        self._session_id = session_id
        self._hub = on_idle
        self._clients: set[asyncio.Queue[object]] = set()
        self._task: asyncio.Task[None] | None = None

    def join(self) -> asyncio.Queue[object]:
        queue: asyncio.Queue[object] = asyncio.Queue(maxsize=CLIENT_BUFFER)
        self._clients.add(queue)
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"fanout-{self._session_id}")
        return queue

    def leave(self, queue: asyncio.Queue[object]) -> None:
        self._clients.discard(queue)
        if not self._clients and self._task is not None:
            self._task.cancel()
            self._task = None
            self._hub.forget(self._session_id, self)

    async def _follow(self) -> None:
        try:
            head = (await self._ledger.get_session(self._session_id)).head_seq
            async for fact in self._ledger.subscribe(self._session_id, head):
                for queue in list(self._clients):
                    with contextlib.suppress(asyncio.QueueFull):
                        # A full queue drops the fact for that client only;
                        # it notices the gap and reads it from the ledger.
                        queue.put_nowait(fact)
        except KeelError as error:
            log.info("fan-out of %s ended: %s", self._session_id, error)
        finally:
            for queue in list(self._clients):
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(_CLOSED)


class FanoutHub:
    def __init__(self, ledger: LedgerClient) -> None:
        self._ledger = ledger
        self._sessions: dict[str, SessionFanout] = {}

    def forget(self, session_id: str, fanout: SessionFanout) -> None:
        if self._sessions.get(session_id) is fanout:
            del self._sessions[session_id]

    async def facts(self, session_id: str, after: int) -> AsyncIterator[CommittedFact]:
        """Every fact with seq > after, in order, backlog then live, forever."""
        fanout = self._sessions.get(session_id)
        if fanout is None:
            fanout = self._sessions[session_id] = SessionFanout(self._ledger, session_id, self)
        queue = fanout.join()
        cursor = after
        try:
            while True:
                # Catch up from the ledger (the backlog, or a gap).
                while True:
                    page, head = await self._ledger.read(session_id, cursor, 500)
                    for fact in page:
                        yield fact
                        cursor = fact.seq
                    if not page or cursor >= head:
                        break
                # Then live, until a gap sends us back to the ledger.
                while True:
                    item = await queue.get()
                    if item is _CLOSED:
                        return
                    assert isinstance(item, CommittedFact)
                    if item.seq <= cursor:
                        continue
                    if item.seq > cursor + 1:
                        # Missed facts (dropped or before the broadcast began).
                        page, _ = await self._ledger.read(session_id, cursor, item.seq - cursor - 1)
                        for fact in page:
                            yield fact
                            cursor = fact.seq
                        if cursor + 1 != item.seq:
                            break
                    yield item
                    cursor = item.seq
        finally:
            fanout.leave(queue)
