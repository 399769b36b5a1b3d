"""Token-level partials and session status, in memory only.

Partials are never facts: a crash loses them by design, and a client that
reconnects gets the committed answer from the ledger instead. The hub fans
them out to `WatchSession` streams (the edge) while this runner owns the
session.

Every partial of a session's current attempt is kept in that attempt's log
(bounded, see `MAX_LOG_ITEMS`), and a watch replays the log before it goes
live. The edge attaches to an attempt only once it has read the attempt's
`epoch_started` fact; with a model that answers at once, the first tokens (or
the whole attempt) are out by then, and without a replay the client would
never see them. Watchers are cursors into the log, not queues: a slow watcher
costs no memory of its own, and one that falls behind the log's bound skips
what was dropped (the committed answer replaces the preview anyway).

When an attempt ends its log is kept for `GRACE_S` (for at most
`GRACE_SESSIONS` sessions), so an edge that asks for it after the fact still
gets every delta: such a watch replays the log and then ends.

A watch's first event is always a status: the session's current one, or,
for an ended attempt asked for by name, the state the attempt ended in (the
replay shows the attempt as it ran; the end of the stream says it is over).

The edge reads the attempt's facts from the ledger and its partials from
here, on two streams: a burst of deltas followed at once by the answer's
commit can reach the edge after the answer itself. So the attempt also marks
its place in the log each time it commits or reads the session's facts
(`committed`): a `Committed(seq)` mark follows every partial published
before it, and `ReplayEnd` says how far the attempt had committed when the
watch began. The edge lets a fact of the attempt out only once the mark that
covers it has come, which puts every delta before the answer it previews.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator

from services.runner.events import (
    RUNNING,
    Committed,
    HubEvent,
    Partial,
    ReplayEnd,
    SessionState,
    StatusChange,
    WatchEvent,
)

# The event values live in `services.runner.events` (the edge reads them from
# there); they are re-exported for the runner's modules that publish them.
__all__ = [
    "GRACE_BYTES",
    "GRACE_S",
    "GRACE_SESSIONS",
    "MAX_LOG_BYTES",
    "MAX_LOG_ITEMS",
    "AttemptLog",
    "Committed",
    "HubEvent",
    "Partial",
    "PartialHub",
    "ReplayEnd",
    "SessionState",
    "StatusChange",
    "WatchEvent",
]

# Bounds of one attempt's log. A late watcher needs the attempt's preview
# only until the answer is committed, while a runaway stream (a model looping
# to a huge output limit) must not grow a runner without limit: these hold
# far more than an ordinary answer (4096 output tokens by default, one item
# per token) and cap the memory of one log at a few MiB. Past them the oldest
# items go first: they belong to the attempt's earliest generations, whose
# committed answers the client gets as facts.
MAX_LOG_ITEMS = 32_768
MAX_LOG_BYTES = 4 * 1024 * 1024
# What an item costs beyond its text (object, fields, deque slot), roughly.
ITEM_OVERHEAD_BYTES = 96
# Ended attempts' logs: the edge asks within milliseconds of seeing the
# attempt's epoch_started; the period only covers a lagging edge. The session
# and byte bounds cap what ended attempts hold however fast sessions churn.
GRACE_S = 15.0
GRACE_SESSIONS = 64
GRACE_BYTES = 32 * 1024 * 1024


class AttemptLog:
    """One attempt's partials and status changes, in order, bounded.

    Entries have absolute positions (`first` .. `end`), so a watcher's cursor
    stays valid while old entries are dropped.
    """

    def __init__(self, epoch: int, attempt_id: str = "") -> None:
        self.epoch = epoch
        # Known once the attempt publishes its first partial.
        self.attempt_id = attempt_id
        self.entries: deque[HubEvent] = deque()
        self.first = 0
        self.bytes = 0
        # The highest seq marked (see `PartialHub.committed`).
        self.committed = 0
        self.ended = False
        self.last_state: SessionState = RUNNING
        self.expires_at = 0.0
        self._changed: asyncio.Future[None] | None = None

    @property
    def end(self) -> int:
        return self.first + len(self.entries)

    def matches(self, epoch: int, attempt_id: str) -> bool:
        if epoch and epoch != self.epoch:
            return False
        return not (attempt_id and self.attempt_id and attempt_id != self.attempt_id)

    def append(self, event: HubEvent) -> None:
        if isinstance(event, Partial):
            if not self.attempt_id:
                self.attempt_id = event.attempt_id
            self.bytes += len(event.text) + ITEM_OVERHEAD_BYTES
        elif isinstance(event, Committed):
            self.committed = event.seq
            self.bytes += ITEM_OVERHEAD_BYTES
        else:
            self.last_state = event.state
            self.bytes += ITEM_OVERHEAD_BYTES
        self.entries.append(event)
        while len(self.entries) > MAX_LOG_ITEMS or self.bytes > MAX_LOG_BYTES:
            dropped = self.entries.popleft()
            self.first += 1
            self.bytes -= ITEM_OVERHEAD_BYTES + (
                len(dropped.text) if isinstance(dropped, Partial) else 0
            )
        self._wake()

    def close(self) -> None:
        self.ended = True
        self._wake()

    def entry(self, position: int) -> HubEvent:
        return self.entries[position - self.first]

    async def changed(self) -> None:
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._changed)

    def _wake(self) -> None:
        waiter, self._changed = self._changed, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class PartialHub:
    def __init__(self) -> None:
        self._status: dict[str, StatusChange] = {}
        self._current: dict[str, AttemptLog] = {}
        # session id -> its latest ended attempt, oldest first.
        self._ended: OrderedDict[str, AttemptLog] = OrderedDict()
        self._ended_bytes = 0

    def owns(self, session_id: str) -> bool:
        return session_id in self._status

    def status(self, session_id: str) -> StatusChange | None:
        return self._status.get(session_id)

    def publish(self, session_id: str, event: Partial | StatusChange) -> None:
        epoch = event.epoch
        log = self._current.get(session_id)
        if log is None or log.epoch != epoch:
            if log is not None:
                self._retire(session_id, log)
            log = self._current[session_id] = AttemptLog(epoch)
        if isinstance(event, StatusChange):
            self._status[session_id] = event
        log.append(event)

    def committed(self, session_id: str, epoch: int, seq: int) -> None:
        """The attempt of `epoch` has committed, or read, the session's facts
        up to `seq`: marks the place in its log (see the module's doc). A
        mark that says nothing new, or one for an attempt no longer current
        here, is dropped."""
        log = self._current.get(session_id)
        if log is not None and log.epoch == epoch and seq > log.committed:
            log.append(Committed(seq))

    def release(self, session_id: str) -> None:
        """This runner stopped owning the session: its watches end once they
        have sent what the attempt published."""
        self._status.pop(session_id, None)
        log = self._current.pop(session_id, None)
        if log is not None:
            self._retire(session_id, log)

    def close_all(self) -> None:
        """The runner stops serving: every watch ends, nothing is kept."""
        for session_id in list(self._current):
            self.release(session_id)
        for log in self._ended.values():
            log.close()
        self._ended.clear()
        self._ended_bytes = 0

    def watchable(self, session_id: str, epoch: int = 0, attempt_id: str = "") -> bool:
        """Whether `watch` with these arguments has anything to say: the
        session is owned here, or the attempt named is (or recently was)."""
        return self._find(session_id, epoch, attempt_id) is not None

    async def watch(
        self, session_id: str, epoch: int = 0, attempt_id: str = ""
    ) -> AsyncGenerator[WatchEvent, None]:
        """A status first; then the partials the attempt has published so far
        and `ReplayEnd`; then live events (partials, statuses, `Committed`
        marks) until the attempt ends.

        Without an attempt (epoch 0, no id) it is the session's current
        attempt. A named attempt that is no longer current is replayed from
        the grace period, and the watch ends after the replay.
        """
        found = self._find(session_id, epoch, attempt_id)
        if found is None:
            return
        log, first = found
        # Fixed before the first yield (no await in between), so nothing
        # published meanwhile is both replayed and sent live, or neither.
        position, replay_end, committed = log.first, log.end, log.committed
        yield first
        replayed = 0
        while position < replay_end:
            position = max(position, log.first)  # dropped while we were sending
            if position >= replay_end:
                break
            event = log.entry(position)
            position += 1
            # Past status changes are history: the first event said where
            # the session is now; past marks are all in ReplayEnd's.
            if isinstance(event, Partial):
                replayed += 1
                yield event
        yield ReplayEnd(replayed, committed)
        while True:
            while position < log.end:
                position = max(position, log.first)
                event = log.entry(position)
                position += 1
                yield event
            if log.ended:
                return
            await log.changed()

    def _find(
        self, session_id: str, epoch: int, attempt_id: str
    ) -> tuple[AttemptLog, StatusChange] | None:
        current = self._current.get(session_id)
        status = self._status.get(session_id)
        if current is not None and status is not None and current.matches(epoch, attempt_id):
            return current, status
        if not (epoch or attempt_id):
            return None
        self._expire()
        ended = self._ended.get(session_id)
        if ended is None or ended.expires_at <= time.monotonic():
            return None
        if not ended.matches(epoch, attempt_id):
            return None
        # Even when a newer attempt runs here now: the stream is about the
        # ended one, and its end says that attempt is over.
        return ended, StatusChange(ended.last_state, ended.epoch)

    def _retire(self, session_id: str, log: AttemptLog) -> None:
        log.close()
        if not any(isinstance(event, Partial) for event in log.entries):
            return  # nothing a late watcher could want
        previous = self._ended.pop(session_id, None)
        if previous is not None:
            self._ended_bytes -= previous.bytes
        log.expires_at = time.monotonic() + GRACE_S
        self._ended[session_id] = log
        self._ended_bytes += log.bytes
        while len(self._ended) > GRACE_SESSIONS or self._ended_bytes > GRACE_BYTES:
            _, oldest = self._ended.popitem(last=False)
            self._ended_bytes -= oldest.bytes
        self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._ended:
            session_id, oldest = next(iter(self._ended.items()))
            if oldest.expires_at > now:
                return
            del self._ended[session_id]
            self._ended_bytes -= oldest.bytes
