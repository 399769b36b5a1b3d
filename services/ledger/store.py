"""Durable session streams on an eventsourcing application, with group commit.

One writer thread owns every decision. It takes whatever appends are queued
(at most one per session per batch, so a failed request never drags another
request of its session down with it), lets each session's aggregate decide,
and saves all the aggregates that changed in ONE transaction. The table lock
eventsourcing's recorder takes per transaction is then paid once per batch,
not once per fact: that is what lets many sessions append faster than a raw
one-row INSERT+COMMIT loop.

If the batch conflicts (another ledger process appended to one of its
sessions), every request of the batch is redone alone on freshly loaded
state, so one contended session never fails the others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from eventsourcing.application import AggregateNotFoundError
from eventsourcing.persistence import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    PersistenceError,
)

from services.common import hops
from services.common.config import Settings
from services.common.errors import DatabaseUnavailable, InternalError, ServiceUnavailable
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
from services.ledger.domain import SessionStream
from services.ledger.errors import LedgerError, SessionExists, SessionNotFound, WriteContention
from services.ledger.event_insert import BatchInsert
from services.ledger.metrics import record_batch
from services.ledger.packed_facts import PackedFact, pack
from services.ledger.stored_facts import FactReader, pack_rows
from services.ledger.views import Appended, SessionView

log = logging.getLogger("keel.ledger.store")

MAX_BATCH = 512
CACHE_SIZE = 4096
CONFLICT_RETRIES = 8

OnCommit = Callable[[Collection[str]], None]
# Committed domain events by session, in seq order.
OnFacts = Callable[[Mapping[str, Sequence[Any]]], None]


@dataclass
class _PendingAppend:
    """One queued append and how to tell its caller the outcome."""

    session_id: str
    new_facts: Sequence[F.NewFact]
    epoch: int
    future: concurrent.futures.Future[list[Appended]] = field(
        default_factory=concurrent.futures.Future
    )
    # Set for callers on an event loop: settled in one loop callback per
    # batch instead of one cross-thread wake-up per append.
    aio_future: asyncio.Future[list[Appended]] | None = None

    def settle(self, outcome: list[Appended] | BaseException) -> None:
        if self.aio_future is None:
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)


def _settle_on_loop(settled: list[tuple[_PendingAppend, list[Appended] | BaseException]]) -> None:
    for pending, outcome in settled:
        target = pending.aio_future
        if target is None or target.done():  # the caller went away
            continue
        if isinstance(outcome, BaseException):
            target.set_exception(outcome)
        else:
            target.set_result(outcome)


_STOP = object()


class LedgerStore:
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

    def submit(
        self, session_id: str, new_facts: Sequence[F.NewFact], epoch: int
    ) -> concurrent.futures.Future[list[Appended]]:
        """Queues an append; the future resolves once it is durable (or refused)."""
        pending = _PendingAppend(session_id, new_facts, epoch)
        self._queue.put(pending)
        return pending.future

    def submit_async(
        self, session_id: str, new_facts: Sequence[F.NewFact], epoch: int
    ) -> asyncio.Future[list[Appended]]:
        """Like submit(), for a caller on the running event loop."""
        pending = _PendingAppend(session_id, new_facts, epoch)
        pending.aio_future = asyncio.get_running_loop().create_future()
        self._queue.put(pending)
        return pending.aio_future

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

    # -- the writer --

    def _write_loop(self) -> None:
        carried: list[_PendingAppend] = []
        while True:
            if carried:
                batch, carried = carried, []
            else:
                item = self._queue.get()
                if item is _STOP:
                    return
                batch = [item]
            while len(batch) < MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._queue.put(_STOP)
                    break
                batch.append(item)
            try:
                carried = self._commit_batch(batch)
            except Exception as error:  # a bug must not kill the only writer
                log.exception("ledger writer failed on a batch")
                with self._lock:
                    for pending in batch:
                        self._forget(pending.session_id)
                self._deliver(
                    [
                        (p, InternalError(f"ledger writer failed: {error}"))
                        for p in batch
                        if not p.future.done() and (p.aio_future is None or not p.aio_future.done())
                    ]
                )
                carried = []

    def _commit_batch(self, batch: list[_PendingAppend]) -> list[_PendingAppend]:
        """Commits one request per session; returns the rest for the next batch."""
        chosen: dict[str, _PendingAppend] = {}
        later: list[_PendingAppend] = []
        for pending in batch:
            if pending.session_id in chosen:
                later.append(pending)
            else:
                chosen[pending.session_id] = pending
        settled: list[tuple[_PendingAppend, list[Appended] | BaseException]] = []
        committed: list[str] = []
        written: dict[str, list[Any]] = {}
        try:
            self._gate.check()
        except DatabaseUnavailable as closed:
            self._deliver([(p, DatabaseUnavailable(closed.message)) for p in chosen.values()])
            return later
        with self._lock:
            decided: list[tuple[_PendingAppend, SessionStream, list[Appended]]] = []
            unreachable: DatabaseUnavailable | None = None
            for pending in chosen.values():
                if unreachable is not None:
                    # The database did not answer one load of this batch:
                    # every other load would wait as long for the same
                    # answer, with the writer (and readers) held up behind.
                    settled.append((pending, DatabaseUnavailable(unreachable.message)))
                    continue
                outcome = self._decide(pending, settled)
                if outcome is not None:
                    decided.append(outcome)
                elif isinstance(settled[-1][1], DatabaseUnavailable):
                    unreachable = settled[-1][1]
            if unreachable is not None:
                self._fail_all(decided, unreachable, settled)
                decided = []
            changed = [stream for _, stream, _ in decided if stream.pending_events]
            saved: list[Any] = []
            try:
                if changed:
                    saved = self._save(changed)
            except IntegrityError:
                for _, stream, _ in decided:
                    self._forget(stream.id)
                for pending, _, _ in decided:
                    self._commit_alone(pending, settled, committed)
            except (PersistenceError, OSError) as exc:
                self._fail_all(decided, exc, settled)
            else:
                self._gate.succeeded()
                self.batches += 1
                self.batched_appends += len(decided)
                record_batch(len(decided))
                settled.extend((pending, results) for pending, _, results in decided)
                if self._on_facts is not None:
                    by_session: dict[str, list[Any]] = {}
                    for event in saved:
                        by_session.setdefault(event.originator_id, []).append(event)
                    written = by_session
                else:
                    committed.extend(stream.id for stream in changed)
        self._deliver(settled)
        if written and self._on_facts is not None:
            self._on_facts(written)
        if committed:
            self._on_commit(committed)
        return later

    def _deliver(
        self, settled: list[tuple[_PendingAppend, list[Appended] | BaseException]]
    ) -> None:
        """Tells every caller of the batch its outcome: one loop wake-up per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for pending, outcome in settled:
            if pending.aio_future is None:
                pending.settle(outcome)
            else:
                by_loop.setdefault(pending.aio_future.get_loop(), []).append((pending, outcome))
        for loop, items in by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle_on_loop, items)

    def _decide(
        self, pending: _PendingAppend, settled: list[Any]
    ) -> tuple[_PendingAppend, SessionStream, list[Appended]] | None:
        stream: SessionStream | None = None
        try:
            stream = self._load(pending.session_id)
            results = stream.record(pending.new_facts, pending.epoch)
        except LedgerError as error:
            if stream is not None and stream.pending_events:
                # A later fact of the request was refused after earlier ones
                # were decided: drop the half-decided copy, keep nothing.
                self._forget(pending.session_id)
            settled.append((pending, error))
            return None
        except (PersistenceError, OSError) as exc:
            settled.append((pending, self._unavailable(exc)))
            return None
        return pending, stream, results

    def _commit_alone(
        self, pending: _PendingAppend, settled: list[Any], committed: list[str]
    ) -> None:
        for _ in range(CONFLICT_RETRIES):
            outcome = self._decide(pending, settled)
            if outcome is None:
                return
            _, stream, results = outcome
            try:
                if stream.pending_events:
                    self._save([stream])
            except IntegrityError:
                self._forget(stream.id)
                continue
            except (PersistenceError, OSError) as exc:
                self._fail_all([outcome], exc, settled)
                return
            settled.append((pending, results))
            committed.append(stream.id)
            return
        error = WriteContention(f"session {pending.session_id!r} kept changing under this append")
        settled.append((pending, error))

    def _fail_all(
        self,
        decided: Sequence[tuple[_PendingAppend, SessionStream, list[Appended]]],
        exc: Exception,
        settled: list[Any],
    ) -> None:
        # Whether the transaction committed is unknown: drop the cached copies
        # and let the caller retry; dedup makes the retry safe.
        log.warning("ledger commit failed: %s", exc)
        said = (
            exc.message if isinstance(exc, DatabaseUnavailable) else self._unavailable(exc).message
        )
        for pending, stream, _ in decided:
            self._forget(stream.id)
            # One exception object per caller: each raises (and tracebacks) its own.
            settled.append((pending, DatabaseUnavailable(said)))

    def _unavailable(self, exc: Exception) -> DatabaseUnavailable:
        """The error callers get for a failure of the database; one that says
        it cannot be reached also closes the gate for a moment."""
        if isinstance(exc, OperationalError | InterfaceError | OSError):
            self._gate.failed()
        return DatabaseUnavailable(f"ledger store unavailable: {exc}")

    # -- the aggregate cache --

    def _save(self, streams: Sequence[SessionStream]) -> list[Any]:
        # The event store directly, not Application.save(): the latter's
        # protocol checks and snapshot/notify hooks cost more CPU than the
        # whole insert on this path, and the ledger uses none of them.
        events = [event for stream in streams for event in stream.collect_events()]
        if self._batch_insert is not None:
            self._batch_insert.put(events)
        else:
            self.app.events.put(events)
        # One transaction, whatever the batch holds (create_session's too).
        hops.committed("ledger")
        return events

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

    def close(self) -> None:
        if self._tail is not None:
            self._tail.stop()
        self._queue.put(_STOP)
        self._writer.join(timeout=10)
        with self._readers_changed:
            self._closed = True
            self._readers_changed.wait_for(lambda: self._readers == 0, timeout=10)
        self.app.close()
