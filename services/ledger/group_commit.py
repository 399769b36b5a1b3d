"""The ledger's group commit: the one writer thread and its batches.

One writer thread owns every decision. It takes whatever appends are queued
(at most one per session per batch, so a failed request never drags another
request of its session down with it), lets each session's aggregate decide,
and saves all the aggregates that changed in ONE transaction. If the batch
conflicts (another ledger process appended to one of its sessions), every
request of the batch is redone alone on freshly loaded state, so one
contended session never fails the others. Callers are told their outcome in
one event-loop wake-up per loop and batch.

Apart from the store's reads and its set-up (services/ledger/store.py)
because this runs on its own thread, with its own failure handling.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eventsourcing.persistence import IntegrityError, PersistenceError

from services.common.errors import DatabaseUnavailable, InternalError
from services.ledger import facts as F
from services.ledger.domain import SessionStream
from services.ledger.errors import LedgerError, WriteContention
from services.ledger.metrics import record_batch, turns_settled
from services.ledger.stream_cache import StreamCache
from services.ledger.views import Appended, Settlement

# The store's logger: the writer's failures are the store's to say.
log = logging.getLogger(__name__)

MAX_BATCH = 512
CONFLICT_RETRIES = 8

OnCommit = Callable[[Collection[str]], None]
# Committed domain events by session, in seq order.
OnFacts = Callable[[Mapping[str, Sequence[Any]]], None]


@dataclass
class PendingAppend:
    """One queued append and how to tell its caller the outcome."""

    session_id: str
    new_facts: Sequence[F.NewFact]
    epoch: int
    # The attempt's Finish to settle in the same transaction, if it can be.
    settlement: Settlement | None = None
    # Commit only while the session owes nothing (SessionBusy otherwise).
    only_if_idle: bool = False
    future: concurrent.futures.Future[list[Appended]] = field(
        default_factory=concurrent.futures.Future
    )
    # Set for callers on an event loop: settled in one loop callback per
    # batch instead of one cross-thread wake-up per append.
    aio_future: asyncio.Future[list[Appended]] | None = None
    # Set by the writer before the outcome: the sticky window's end when
    # `settle` was done in the append's transaction, else 0.
    sticky_until_ms: int = 0

    def settle(self, outcome: list[Appended] | BaseException) -> None:
        if self.aio_future is None:
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)


def settle_on_loop(settled: list[tuple[PendingAppend, list[Appended] | BaseException]]) -> None:
    for pending, outcome in settled:
        target = pending.aio_future
        if target is None or target.done():  # the caller went away
            continue
        if isinstance(outcome, BaseException):
            target.set_exception(outcome)
        else:
            target.set_result(outcome)


def _settles(
    decided: Sequence[tuple[PendingAppend, SessionStream, list[Appended]]],
) -> dict[str, tuple[int, Settlement]]:
    """The Finishes to settle with a batch: those of appends that write.
    A duplicate writes nothing, so its turn was settled (or not) with the
    original, and its runner learns nothing here: it sends its Finish."""
    return {
        pending.session_id: (pending.epoch, pending.settlement)
        for pending, stream, _ in decided
        if pending.settlement is not None and stream.pending_events
    }


# Put on the queue by close(): the writer ends once it reaches it.
STOP = object()


class GroupCommit(StreamCache):
    """The writer thread's loop and batches; the store starts the thread on
    `_write_loop` and sets the attributes below in its __init__."""

    _queue: queue.SimpleQueue[Any]
    _lock: threading.RLock
    _on_commit: OnCommit
    _on_facts: OnFacts | None
    batches: int
    batched_appends: int

    def _write_loop(self) -> None:
        carried: list[PendingAppend] = []
        while True:
            if carried:
                batch, carried = carried, []
            else:
                item = self._queue.get()
                if item is STOP:
                    return
                batch = [item]
            while len(batch) < MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is STOP:
                    self._queue.put(STOP)
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

    def _commit_batch(self, batch: list[PendingAppend]) -> list[PendingAppend]:
        """Commits one request per session; returns the rest for the next batch."""
        chosen: dict[str, PendingAppend] = {}
        later: list[PendingAppend] = []
        for pending in batch:
            if pending.session_id in chosen:
                later.append(pending)
            else:
                chosen[pending.session_id] = pending
        settled: list[tuple[PendingAppend, list[Appended] | BaseException]] = []
        committed: list[str] = []
        written: dict[str, list[Any]] = {}
        try:
            self._gate.check()
        except DatabaseUnavailable as closed:
            self._deliver([(p, DatabaseUnavailable(closed.message)) for p in chosen.values()])
            return later
        with self._lock:
            decided: list[tuple[PendingAppend, SessionStream, list[Appended]]] = []
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
                    saved, settled_until = self._save(changed, _settles(decided))
                    for pending, _, _ in decided:
                        pending.sticky_until_ms = settled_until.get(pending.session_id, 0)
                    turns_settled(len(settled_until))
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

    def _deliver(self, settled: list[tuple[PendingAppend, list[Appended] | BaseException]]) -> None:
        """Tells every caller of the batch its outcome: one loop wake-up per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for pending, outcome in settled:
            if pending.aio_future is None:
                pending.settle(outcome)
            else:
                by_loop.setdefault(pending.aio_future.get_loop(), []).append((pending, outcome))
        for loop, items in by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle_on_loop, items)

    def _decide(
        self, pending: PendingAppend, settled: list[Any]
    ) -> tuple[PendingAppend, SessionStream, list[Appended]] | None:
        stream: SessionStream | None = None
        try:
            stream = self._load(pending.session_id)
            results = stream.record(pending.new_facts, pending.epoch, pending.only_if_idle)
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
        self, pending: PendingAppend, settled: list[Any], committed: list[str]
    ) -> None:
        for _ in range(CONFLICT_RETRIES):
            outcome = self._decide(pending, settled)
            if outcome is None:
                return
            _, stream, results = outcome
            try:
                if stream.pending_events:
                    _, settled_until = self._save([stream], _settles([outcome]))
                    pending.sticky_until_ms = settled_until.get(pending.session_id, 0)
                    turns_settled(len(settled_until))
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
        decided: Sequence[tuple[PendingAppend, SessionStream, list[Appended]]],
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
