"""A runner frozen mid-answer and taken over, for the edge's tests.

`Frozen` SIGSTOPs a runner process and makes sure it is resumed. The two
ledger clients force one interleaving of an edge fan-out's reads with a
takeover: the ledger is real, only the moment a call returns is chosen (as
tests/edge/test_fanout_join.py does for a commit between two reads).
`Follower` is one client of a fan-out, reading what it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from edge.fanout import FanoutHub, Live
from services.common.config import Settings
from services.ledger import CommittedFact, LedgerClient, SessionView
from tests.support.polling import eventually
from tests.support.processes import ChildProcess


class Frozen:
    """SIGSTOPs a runner; `resume` (idempotent) SIGCONTs it. Use it with
    `finally: frozen.resume()` so no stopped process outlives a test."""

    def __init__(self, runner: ChildProcess) -> None:
        self._runner = runner
        self.stopped = False

    def stop(self) -> None:
        os.kill(self._runner.pid, signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        if self.stopped and self._runner.proc.poll() is None:
            os.kill(self._runner.pid, signal.SIGCONT)
        self.stopped = False


async def epoch_started_after(
    ledger: LedgerClient, session_id: str, epoch: int, deadline_s: float
) -> CommittedFact:
    """The first epoch_started of an epoch above `epoch`, once committed."""

    async def probe() -> CommittedFact | None:
        facts = await ledger.read_all(session_id)
        return next((f for f in facts if f.kind == "epoch_started" and f.epoch > epoch), None)

    return await eventually(probe, f"an epoch after {epoch} to start", deadline_s)


class HeadAfterTakeover(LedgerClient):
    """The first `get_session` (where a fan-out reads the head its
    subscription starts after) returns only once an epoch after `epoch` has
    started: the head then includes the successor's epoch_started, so no
    live fact will name the successor."""

    def __init__(self, target: str, settings: Settings, epoch: int, deadline_s: float) -> None:
        super().__init__(target, settings)
        self._epoch = epoch
        self._deadline_s = deadline_s
        self._gated = False

    async def get_session(self, session_id: str) -> SessionView:
        if not self._gated:
            self._gated = True
            await epoch_started_after(self, session_id, self._epoch, self._deadline_s)
        return await super().get_session(session_id)


class NewEpochHeldBack(LedgerClient):
    """Subscriptions hold back an epoch_started of an epoch above `epoch`
    (and every later fact) until `release` is set: the fan-out learns of the
    takeover after its clients' own reads of the ledger do."""

    def __init__(self, target: str, settings: Settings, epoch: int) -> None:
        super().__init__(target, settings)
        self._epoch = epoch
        self.release = asyncio.Event()

    async def subscribe(self, session_id: str, after_seq: int = 0) -> AsyncIterator[CommittedFact]:
        async for fact in super().subscribe(session_id, after_seq):
            if fact.kind == "epoch_started" and fact.epoch > self._epoch:
                await self.release.wait()
            yield fact


class Follower:
    """One client of a fan-out: everything `follow` yields, in order."""

    def __init__(self, hub: FanoutHub, session_id: str, after: int = 0) -> None:
        self.items: list[Live] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._read(hub.follow(session_id, after)))

    async def _read(self, follow: AsyncGenerator[list[Live], None]) -> None:
        async with contextlib.aclosing(follow) as batches:
            async for batch in batches:
                self.items.extend(batch)
                self._changed.set()

    async def until(self, matches: Callable[[Live], bool], what: str, deadline_s: float) -> Live:
        """The first item that `matches`, waiting for it until the deadline."""
        # Woken by each batch the follower reads, not polled
        # (tests.support.polling), and it fails as soon as the stream ends.
        deadline = time.monotonic() + deadline_s
        while True:
            self._changed.clear()
            found = next((item for item in self.items if matches(item)), None)
            if found is not None:
                return found
            if self._task.done():
                self._task.result()  # its failure, if it failed
                raise AssertionError(f"the stream ended before {what}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {what}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
