"""One session's two sources, merged into the one order its clients see.

A session's clients are sent the ledger's facts (the edge's subscription)
and the partials of the attempt at work (a watch of its runner). The two
come on separate streams, and the order in which they reach the edge is not
the order in which they happened: a provider that sends a whole answer at
once has the runner publish every delta and commit the answer a moment
later, and the answer's fact can reach the edge while its deltas are still
on the way. A client sent the answer first drops those deltas (they would
start a preview that no fact ends).

So the runner marks its stream (services/runner/hub.py): after each fact the
attempt commits or reads comes `Committed(seq)`, behind every partial
published before it, and a watch's `ReplayEnd` says how far the attempt had
committed when the watch began. The merge queues facts in seq order and lets
the head out unless the watched attempt wrote it (its epoch) and no mark has
covered it yet; partials go out as they come. Every delta therefore precedes
the facts committed after it, however the two streams are timed, and facts
of other writers (inputs, approvals) wait only behind such a fact.

Which attempt is watched: an `epoch_started` fact, once out, names its
attempt and runtime, and the merge asks for a watch of exactly that attempt
(which replays what it published before the watch began; a newer attempt
ends the watch of the older one at once). Before any, the owner the kernel
names is watched (a client joining mid-attempt); its first status tells
the epoch, and an `epoch_started` of that same epoch then starts no second
watch (it would replay every delta twice).

Facts stop waiting for a watch when it ends (the runner released the
attempt, or failed: nothing more can come), when it turns out to come from
a runner that sends no marks (a `ReplayEnd` without `committed`), and when
the runner has sent nothing for STALL_S while a fact waits (a frozen or
partitioned owner must not hold the session back); and no more than
MAX_WAITING facts wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from edge.fanout_clients import attempt_epoch
from services.ledger import CommittedFact
from services.ledger.facts import EPOCH_STARTED
from services.runner.events import IDLE, Committed, Partial, ReplayEnd, StatusChange, WatchEvent

log = logging.getLogger(__name__)
# A fact waits for its mark only while the runner says something at least
# this often, and only this many facts wait (past either, they go out:
# facts are never held back for a preview by a runner that is not there).
STALL_S = 2.0
MAX_WAITING = 256
NOTHING_RUNS = StatusChange(IDLE, 0)

Merged: TypeAlias = CommittedFact | Partial | StatusChange


@dataclass(frozen=True)
class Attempt:
    """An attempt as its epoch_started fact names it."""

    runtime_id: str
    epoch: int
    attempt_id: str

    @classmethod
    def of(cls, fact: CommittedFact) -> Attempt:
        data = fact.data
        return cls(
            runtime_id=str(data.get("runtimeId") or ""),
            epoch=attempt_epoch(fact),
            attempt_id=str(data.get("attemptId") or ""),
        )


# Starts watch number n of the attempt named (None: the session's owner,
# as the kernel says); a newer watch replaces the one running.
StartWatch: TypeAlias = Callable[[int, Attempt | None], None]


class SessionMerge:
    """The ordering of one session's facts and partials (no I/O of its own:
    the fan-out feeds it both streams and sends what it emits)."""

    def __init__(self, emit: Callable[[Merged], None], start_watch: StartWatch) -> None:
        self._emit = emit
        self._start_watch = start_watch
        self._facts: deque[CommittedFact] = deque()
        # The current watch: its number (events of older ones are stale),
        # the epoch it follows (0 until known), the highest seq its marks
        # covered, and whether facts of its epoch wait for those marks.
        self._watch = 0
        self._epoch = 0
        self._marked = 0
        self._waits = False
        self._stall: asyncio.TimerHandle | None = None
        self.status: StatusChange = NOTHING_RUNS

    # -- the ledger's side --

    def fact(self, fact: CommittedFact) -> None:
        self._facts.append(fact)
        self._release()

    def close(self) -> None:
        """The ledger stream ended: whatever waits goes out now."""
        self._waits = False
        self._release()

    # -- the runner's side --

    def watch_owner(self) -> None:
        """Watches whoever owns the session now (asked once the ledger
        subscription has fixed its head; see edge/fanout.py)."""
        if not self._watch:
            self._follow(None)

    def watch_event(self, watch: int, event: WatchEvent) -> None:
        if watch != self._watch:
            return  # a watch already replaced: its attempt is superseded
        if self._stall is not None:
            self._arm_stall()  # the runner is there: wait on
        if isinstance(event, Committed):
            self._marked = max(self._marked, event.seq)
            self._release()
        elif isinstance(event, ReplayEnd):
            if event.committed is None:
                self._waits = False  # no marks will come
            else:
                self._marked = max(self._marked, event.committed)
            self._release()
        else:
            if isinstance(event, StatusChange):
                # A watch of the owner learns its epoch from its first status.
                self._epoch = self._epoch or event.epoch
                self.status = event
            self._emit(event)

    def watch_ended(self, watch: int) -> None:
        """The watch's stream ended: all it had was sent."""
        if watch != self._watch:
            return
        self._waits = False
        self._release()
        if self.status.state != IDLE:
            self.status = NOTHING_RUNS
            self._emit(NOTHING_RUNS)

    # -- ordering --

    def _follow(self, attempt: Attempt | None) -> None:
        self._watch += 1
        self._epoch = attempt.epoch if attempt is not None else 0
        self._marked = 0
        # An attempt without a runtime is looked up like an owner.
        self._waits = attempt is None or bool(attempt.runtime_id)
        self._start_watch(self._watch, attempt)

    def _waiting(self, fact: CommittedFact) -> bool:
        return (
            self._waits
            and fact.epoch == self._epoch != 0
            and fact.seq > self._marked
            and len(self._facts) <= MAX_WAITING
        )

    def _release(self) -> None:
        facts = self._facts
        while facts:
            fact = facts[0]
            if self._waiting(fact):
                if self._stall is None:
                    self._arm_stall()
                return
            facts.popleft()
            self._emit(fact)
            if fact.kind == EPOCH_STARTED:
                attempt = Attempt.of(fact)
                # Not when the watch of the owner already follows it (or a
                # newer one): a second watch would replay its deltas again.
                if attempt.epoch > self._epoch:
                    self._follow(attempt)
        self._disarm_stall()

    def _arm_stall(self) -> None:
        self._disarm_stall()
        self._stall = asyncio.get_running_loop().call_later(STALL_S, self._stalled, self._watch)

    def _disarm_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self, watch: int) -> None:
        self._stall = None
        if watch == self._watch and self._waits:
            log.info("the watch of epoch %d is silent: its facts go out unmarked", self._epoch)
            self._waits = False
            self._release()
