"""The ledger store's cache of session aggregates, and how they are saved.

Both sides of the store use it: the writer thread decides appends on the
cached aggregates and saves them, and `create_session` and `view` read and
save through it too, all under the store's lock. It is apart from the writer
(services/ledger/group_commit.py) and the reads (services/ledger/store.py)
because it is what they share: the aggregates, the event store they are
saved to, and the outage gate a failure of that store closes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from eventsourcing.application import AggregateNotFoundError
from eventsourcing.persistence import InterfaceError, OperationalError

from services.common import hops
from services.common.errors import DatabaseUnavailable
from services.common.pg_pool import OutageGate
from services.ledger.backend import LedgerApplication
from services.ledger.domain import SessionStream
from services.ledger.errors import SessionNotFound
from services.ledger.event_insert import BatchInsert
from services.ledger.views import Settlement

CACHE_SIZE = 4096


class StreamCache:
    """Aggregates by session, least recently used first; the store sets the
    attributes below in its __init__ (services.ledger.store.LedgerStore)."""

    app: LedgerApplication
    # Guarded by the store's lock, which the writer holds for a whole batch.
    _streams: OrderedDict[str, SessionStream]
    # The writer's inserts on PostgreSQL: one statement per batch.
    _batch_insert: BatchInsert | None
    _gate: OutageGate

    def _unavailable(self, exc: Exception) -> DatabaseUnavailable:
        """The error callers get for a failure of the database; one that says
        it cannot be reached also closes the gate for a moment."""
        if isinstance(exc, OperationalError | InterfaceError | OSError):
            self._gate.failed()
        return DatabaseUnavailable(f"ledger store unavailable: {exc}")

    def _save(
        self,
        streams: Sequence[SessionStream],
        settles: Mapping[str, tuple[int, Settlement]] | None = None,
    ) -> tuple[list[Any], dict[str, int]]:
        """Saves the streams' new events; settles the turns of `settles`
        ({session: (epoch, settlement)}) in the same transaction where this
        database allows (PostgreSQL, with the kernel's tables). Returns the
        events, and the sticky window's end of each session settled."""
        # The event store directly, not Application.save(): the latter's
        # protocol checks and snapshot/notify hooks cost more CPU than the
        # whole insert on this path, and the ledger uses none of them.
        events = [event for stream in streams for event in stream.collect_events()]
        settled: dict[str, int] = {}
        if self._batch_insert is not None:
            settled = self._batch_insert.put(events, settles)
        else:
            self.app.events.put(events)
        # One transaction, whatever the batch holds (create_session's too).
        hops.committed("ledger")
        return events, settled

    def _load(self, session_id: str) -> SessionStream:
        stream = self._streams.get(session_id)
        if stream is not None:
            self._streams.move_to_end(session_id)
            return stream
        try:
            stream = self.app.repository.get(session_id)
        except AggregateNotFoundError:
            raise SessionNotFound(f"no session {session_id!r}") from None
        assert isinstance(stream, SessionStream)
        self._remember(stream)
        return stream

    def _fast_forward(self, stream: SessionStream) -> None:
        for event in self.app.events.get(stream.id, gt=stream.version):
            assert isinstance(event, SessionStream.Event)
            event.mutate(stream)

    def _remember(self, stream: SessionStream) -> None:
        self._streams[stream.id] = stream
        self._streams.move_to_end(stream.id)
        while len(self._streams) > CACHE_SIZE:
            self._streams.popitem(last=False)

    def _forget(self, session_id: str) -> None:
        self._streams.pop(session_id, None)
