"""Durable session streams on an eventsourcing application, with group commit.

Appends are queued for the one writer thread (services/ledger/group_commit.py),
which commits each batch of them in ONE transaction: the table lock
eventsourcing's recorder takes per transaction is then paid once per batch,
not once per fact, which is what lets many sessions append faster than a raw
one-row INSERT+COMMIT loop. Reads go to the rows directly, on the caller's
thread; the aggregates both sides share are services/ledger/stream_cache.py.
This module sets the store up, takes the appends, serves the reads and
closes it all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from eventsourcing.persistence import IntegrityError, PersistenceError

from services.common import hops
from services.common.config import Settings
from services.common.errors import ServiceUnavailable
from services.common.pg_pool import OutageGate, answers
from services.ledger import facts as F
from services.ledger.backend import (
    LedgerApplication,
    LiveTail,
    SessionNotifyingRecorder,
    StreamRows,
    backend_env,
    list_originators,
    prepare_backend,
)
from services.ledger.domain import SessionStream, forked_from_event
from services.ledger.errors import InvalidCursor, SessionExists, SessionNotFound
from services.ledger.event_insert import BatchInsert
from services.ledger.group_commit import STOP, GroupCommit, OnCommit, OnFacts, PendingAppend
from services.ledger.packed_facts import PackedFact, pack
from services.ledger.stored_facts import FactReader, pack_rows
from services.ledger.views import Appended, SessionView, Settlement

# Facts read per page while copying a parent's history into a fork.
FORK_PAGE = 1000


class LedgerStore(GroupCommit):
    """Session streams: append through the group committer, read directly.

    Owns the eventsourcing application (the events table), the cache of
    session aggregates, the writer thread that commits each batch of appends
    in one transaction, and on PostgreSQL the `LiveTail` that hears other
    ledger processes' commits.

    Built by `services.ledger.server`; called by `LedgerServicer`, the
    ledger's gRPC surface.
    """

    def __init__(
        self,
        settings: Settings,
        on_commit: OnCommit | None = None,
        on_facts: OnFacts | None = None,
    ) -> None:
        prepare_backend(settings)
        self.app = LedgerApplication(env=backend_env(settings))
        # Reads go to the rows directly (see stored_facts): the mapper's
        # decode and the servicer's re-encode were most of a Read's cost.
        self._rows = StreamRows(self.app.recorder)
        self._fact_reader = FactReader(self.app.mapper)
        self._on_commit = on_commit or (lambda ids: None)
        # The writer's own commits, with their events: subscribers of this
        # process take them from memory (services.ledger.waker).
        self._on_facts = on_facts
        # Aggregates by session, least recently used first. Guarded by _lock,
        # which the writer holds for a whole batch (decide + save), so readers
        # never observe a decision that was not committed.
        self._streams: OrderedDict[str, SessionStream] = OrderedDict()
        self._lock = threading.RLock()
        self._readers = 0
        self._closed = False
        self._readers_changed = threading.Condition()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="ledger-writer", daemon=True)
        self._writer.start()
        # Commits of other ledger processes on the same PostgreSQL.
        self._tail: LiveTail | None = None
        # The writer's inserts on PostgreSQL: one statement per batch.
        self._batch_insert: BatchInsert | None = None
        if settings.uses_postgres:
            recorder = self.app.recorder
            assert isinstance(recorder, SessionNotifyingRecorder)
            self._batch_insert = BatchInsert(recorder, self.app.mapper)
            self._tail = LiveTail(
                settings.database_url,
                recorder.session_channel,
                self._on_commit,
                # Only when the writer's commits are announced in-process.
                self._batch_insert.backends if on_facts is not None else (),
            )
            self._tail.start()
        self.batches = 0
        self.batched_appends = 0
        self._gate = OutageGate(
            "ledger store",
            probe=answers(settings.database_url) if settings.uses_postgres else None,
        )

    # -- writes --

    def create_session(self, session_id: str, tenant_id: str) -> bool:
        """Creates the stream; False if it already exists for this tenant."""
        with self._reading(), self._lock:
            stream = SessionStream(session_id=session_id, tenant_id=tenant_id)
            try:
                self._save([stream])
            except IntegrityError:
                existing = self._load(session_id)
                if existing.tenant_id != tenant_id:
                    raise SessionExists(f"session {session_id!r} exists") from None
                return False
            self._remember(stream)
        self._on_commit((session_id,))
        return True

    def fork_session(self, parent_id: str, session_id: str, at_seq: int) -> int:
        """Creates `session_id` with `parent_id`'s facts 2..`at_seq` after its
        own creation fact, then `forked_from`; returns its head. One
        transaction: the fork exists whole or not at all. On PostgreSQL the
        parent's rows are copied by the server (services/ledger/event_insert.py);
        on SQLite through the aggregate, as any write."""
        with self._reading(), self._lock:
            parent = self._load(parent_id)
            if at_seq > parent.version:
                raise InvalidCursor(
                    f"seq {at_seq} is past the head {parent.version} of the session", field="at"
                )
            stream = SessionStream(session_id=session_id, tenant_id=parent.tenant_id)
            origin = {"sessionId": parent_id, "seq": at_seq}
            try:
                if self._batch_insert is not None:
                    marker = forked_from_event(session_id, at_seq + 1, origin)
                    events = [*stream.collect_events(), marker]
                    self._batch_insert.put_fork(events, parent_id, session_id, at_seq)
                    hops.committed("ledger")
                else:
                    copied = self._copied(parent_id, at_seq)
                    stream.copy_of(copied)
                    forked = F.CommittedFact(session_id, at_seq + 1, F.FORKED_FROM, origin, 0, 0)
                    stream.copy_of([forked])
                    self._save([stream])
                    self._remember(stream)
            except IntegrityError:
                raise SessionExists(f"session {session_id!r} exists") from None
        self._on_commit((session_id,))
        return at_seq + 1

    def _copied(self, parent_id: str, at_seq: int) -> list[F.CommittedFact]:
        """The parent's facts 2..`at_seq`, read a page at a time."""
        copied: list[F.CommittedFact] = []
        while len(copied) + 1 < at_seq:
            after = len(copied) + 1
            copied.extend(self.read(parent_id, after, min(FORK_PAGE, at_seq - after)))
        return copied

    def submit(
        self, session_id: str, new_facts: Sequence[F.NewFact], epoch: int
    ) -> concurrent.futures.Future[list[Appended]]:
        """Queues an append; the future resolves once it is durable (or refused)."""
        pending = PendingAppend(session_id, new_facts, epoch)
        self._queue.put(pending)
        return pending.future

    def submit_async(
        self,
        session_id: str,
        new_facts: Sequence[F.NewFact],
        epoch: int,
        settle: Settlement | None = None,
        only_if_idle: bool = False,
    ) -> PendingAppend:
        """Like submit(), for a caller on the running event loop: the
        outcome is the returned append's `aio_future`. With `settle`, the
        append's transaction may settle the attempt's lease too
        (`sticky_until_ms`, set when the outcome is). `only_if_idle`: commit
        only while the session owes nothing (SessionBusy otherwise)."""
        pending = PendingAppend(session_id, new_facts, epoch, settle, only_if_idle)
        pending.aio_future = asyncio.get_running_loop().create_future()
        self._queue.put(pending)
        return pending

    def append(self, session_id: str, new_facts: Sequence[F.NewFact], epoch: int) -> list[Appended]:
        return self.submit(session_id, new_facts, epoch).result()

    # -- reads --

    @contextmanager
    def _reading(self) -> Iterator[None]:
        # Reads run on worker threads; close() waits for them, because closing
        # a connection another thread is using can crash the process (SQLite).
        with self._readers_changed:
            if self._closed:
                raise ServiceUnavailable("the ledger store is closed")
            self._readers += 1
        try:
            self._gate.check()
            yield
        except (PersistenceError, OSError) as exc:
            # The database went away (an IntegrityError a caller expects is
            # caught inside): a retryable UNAVAILABLE, never an INTERNAL.
            raise self._unavailable(exc) from exc
        except BaseException:
            # The caller's own error (an unknown session, say): nothing
            # learnt about the database, so another caller may probe it.
            self._gate.released()
            raise
        else:
            self._gate.succeeded()
        finally:
            with self._readers_changed:
                self._readers -= 1
                self._readers_changed.notify_all()

    def read(self, session_id: str, after_seq: int, limit: int) -> list[F.CommittedFact]:
        """Facts after `after_seq`, in one query: for a subscriber, which
        checked once that the session exists and needs no head."""
        with self._reading():
            rows = self._rows.rows(session_id, after_seq, limit)
            return self._fact_reader.facts(session_id, rows)

    def read_page(
        self, session_id: str, after_seq: int, limit: int
    ) -> tuple[list[F.CommittedFact], int]:
        """Facts after `after_seq` and the stream's head, in one statement."""
        with self._reading():
            rows, head = self._rows.page(session_id, after_seq, limit)
            if head == 0:  # every session starts with its creation fact
                raise SessionNotFound(f"no session {session_id!r}")
            return self._fact_reader.facts(session_id, rows), head

    def read_packed(
        self, session_id: str, after_seq: int, limit: int, max_bytes: int
    ) -> tuple[bytes, int]:
        """Up to `limit` facts after `after_seq` as one packed page of at
        most `max_bytes` (never less than one fact), and the stream's head.

        Rows are fetched MAX_READ_LIMIT at a time, so what is held beyond
        the page itself is never more than an unpacked page holds."""
        elements: list[PackedFact] = []
        room = max_bytes
        with self._reading():
            while True:
                chunk = min(limit - len(elements), F.MAX_READ_LIMIT)
                rows, head = self._rows.page(session_id, after_seq, chunk)
                if head == 0:  # every session starts with its creation fact
                    raise SessionNotFound(f"no session {session_id!r}")
                room = pack_rows(self._fact_reader, session_id, rows, room, elements)
                if room < 0 or len(rows) < chunk or len(elements) >= limit:
                    break
                after_seq = rows[-1][0]
                if after_seq >= head:
                    break
        return pack(elements), head

    def head(self, session_id: str) -> int:
        with self._reading():
            return self._rows.head(session_id)

    def exists(self, session_id: str) -> bool:
        with self._reading():
            return self._rows.head(session_id) > 0

    def view(self, session_id: str) -> SessionView:
        """Derived state, brought up to date with what other processes wrote."""
        with self._reading(), self._lock:
            stream = self._load(session_id)
            self._fast_forward(stream)
            return stream.view()

    def session_ids(self, after: str, limit: int) -> list[str]:
        with self._reading():
            return list_originators(self.app.recorder, after, limit)

    def close(self) -> None:
        if self._tail is not None:
            self._tail.stop()
        self._queue.put(STOP)
        self._writer.join(timeout=10)
        with self._readers_changed:
            self._closed = True
            self._readers_changed.wait_for(lambda: self._readers == 0, timeout=10)
        self.app.close()
