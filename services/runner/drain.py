"""Draining a runner: stop claiming, settle or stop what runs, hand it back.

A drain is one-way once it finishes: the runner is replaced, never revived
(a standalone process exits, `keel up` starts a new runner in its place).
Until then it can be undone, and the runner claims again.

- `handoff`: in-flight attempts go on to their next commit boundary, where
  they stop (`HandoffStop`) and hand the session back. Attempts still
  running at the deadline are stopped where they are.
- `shutdown`: in-flight attempts are stopped where they are, at once.

An attempt stopped where it is has its task cancelled *and awaited* (with
every task it started), so nothing of it commits after the drain returns;
its lease is then released at once, not left to the TTL. A session handed
back with work still owed is a handoff: the release carries a note, and the
kernel writes the audit row in the same transaction. A session whose work
was done (stopped after its final answer) is finished as usual: no row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from kernel import KernelClient, Lease
from kernel.domain import DrainMode
from kernel.handoffs import HandoffNote
from services.common.errors import KeelError
from services.ledger import LedgerClient
from services.runner import metrics as runner_metrics
from services.runner import transcript as T
from services.runner.attempt import Attempt

log = logging.getLogger(__name__)

# Phases of a drain: waiting for commit boundaries, stopping what is left, done.
_WAITING, _STOPPING, _FINISHED = "waiting", "stopping", "finished"


@dataclass(frozen=True)
class DrainResult:
    # Runs in flight when the drain began.
    in_flight: int
    # Runs stopped where they were (shutdown, or a handoff past its deadline).
    stopped: int = 0
    # Undone before it finished: the runner claims again.
    undone: bool = False
    # Finished: the runner exits (or is replaced).
    finished: bool = False


@dataclass
class Running:
    """One claimed session being worked on: its task, lease and attempt
    (None until the attempt is built)."""

    task: asyncio.Task[None]
    lease: Lease
    attempt: Attempt | None = None


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancels `tasks` and waits until every one has ended, even if the
    caller is cancelled meanwhile (it is cancelled after the wait), and
    retrieves their outcomes: a task left running, or an exception nobody
    read, is exactly what must not outlive an attempt."""
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    interrupted = False
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            interrupted = True
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
    if interrupted:
        raise asyncio.CancelledError


class Drainer:
    """The drain state of one runtime.

    `claims` starts or stops the runtime's claim loop; `running` is the
    runtime's map of in-flight sessions; `idle` is set when it is empty.
    """

    def __init__(
        self,
        runtime_id: str,
        kernel: KernelClient,
        ledger: LedgerClient,
        running: dict[str, Running],
        idle: asyncio.Event,
        stop_claiming: Callable[[], Coroutine[Any, Any, None]],
        start_claiming: Callable[[], None],
    ) -> None:
        self._runtime_id = runtime_id
        self._kernel = kernel
        self._ledger = ledger
        self._running = running
        self._idle = idle
        self._stop_claiming = stop_claiming
        self._start_claiming = start_claiming
        self.mode = DrainMode.NONE
        self.in_flight = 0
        # Set when the drain has finished: the runtime must go.
        self.finished = asyncio.Event()
        self._phase = ""
        self._task: asyncio.Task[DrainResult] | None = None
        self._result: DrainResult | None = None
        # Stops the wait for commit boundaries (an undo, or a shutdown).
        self._wake = asyncio.Event()
        # Drain and undo change the kernel's drain mode and the claim loop
        # one at a time, so the kernel never ends up with a stale mode.
        self._lock = asyncio.Lock()

    def start(self, mode: DrainMode, deadline_ms: int) -> asyncio.Task[DrainResult]:
        """Marks the runtime draining now (attempts see it at their next
        boundary) and returns the task that completes the drain. A drain
        already under way is joined; a shutdown hurries a handoff along."""
        if mode not in (DrainMode.HANDOFF, DrainMode.SHUTDOWN):
            raise ValueError(f"mode must be handoff or shutdown, got {mode!r}")
        task = self._task
        if task is not None and (not task.done() or self._result is not None):
            # Under way (joined; a shutdown hurries a handoff), or finished.
            if not task.done() and mode == DrainMode.SHUTDOWN and self.mode == DrainMode.HANDOFF:
                self.mode = DrainMode.SHUTDOWN
                self._wake.set()
            return task
        self.mode = mode
        self.in_flight = len(self._running)
        self._phase = _WAITING
        self._wake.clear()
        self._task = asyncio.get_running_loop().create_task(
            self._drain(deadline_ms), name=f"drain-{self._runtime_id}"
        )
        return self._task

    async def undo(self) -> DrainResult:
        """Undoes a drain that has not finished: the runtime claims again."""
        async with self._lock:
            if self._phase in (_STOPPING, _FINISHED):
                return DrainResult(self.in_flight, finished=True)
            if self.mode == DrainMode.NONE:
                return DrainResult(0)
            self.mode = DrainMode.NONE
            self._phase = ""
            self._wake.set()
            await self._tell_kernel(DrainMode.NONE)
            self._start_claiming()
        log.info("runtime %s: drain undone; claiming again", self._runtime_id)
        return DrainResult(self.in_flight, undone=True)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _tell_kernel(self, mode: DrainMode) -> None:
        try:
            await self._kernel.set_drain(self._runtime_id, mode)
        except KeelError as error:
            # The registry shows it late; the runtime itself no longer claims.
            log.warning("could not record drain %s of %s: %s", mode, self._runtime_id, error)

    def _undone(self) -> bool:
        # A method, not an inline test: an undo may change the mode while
        # the drain waits, which a type checker's narrowing cannot see.
        return self.mode == DrainMode.NONE

    async def _drain(self, deadline_ms: int) -> DrainResult:
        began = time.perf_counter()
        async with self._lock:
            if self._undone():
                return DrainResult(self.in_flight, undone=True)
            await self._tell_kernel(self.mode)
            await self._stop_claiming()
        if self.mode == DrainMode.HANDOFF:
            await self._settle(deadline_ms)
        async with self._lock:
            if self._undone():
                return DrainResult(self.in_flight, undone=True)
            self._phase = _STOPPING
        stopped = await self._stop_running()
        self._phase = _FINISHED
        self._result = DrainResult(self.in_flight, stopped, finished=True)
        log.info(
            "runtime %s drained (%s): %d in flight, %d stopped where they were",
            self._runtime_id,
            self.mode,
            self.in_flight,
            stopped,
        )
        runner_metrics.drain_finished(self.mode, (time.perf_counter() - began) * 1000)
        self.finished.set()
        return self._result

    async def _settle(self, deadline_ms: int) -> None:
        """Waits for every attempt to reach a boundary, the deadline, or a wake."""
        idle = asyncio.ensure_future(self._idle.wait())
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait(
                {idle, woken}, timeout=deadline_ms / 1000, return_when="FIRST_COMPLETED"
            )
        finally:
            await cancel_and_wait([idle, woken])

    async def _stop_running(self) -> int:
        running = list(self._running.values())
        await cancel_and_wait([r.task for r in running])
        outcomes = await asyncio.gather(*(self._give_back(r) for r in running))
        return sum(outcomes)

    async def _give_back(self, running: Running) -> bool:
        """Gives a stopped attempt's session back at once; False when its
        lease was no longer ours (it had finished on its own)."""
        lease, attempt = running.lease, running.attempt
        try:
            if await self._owes_work(lease.session_id):
                revision = attempt.loadout.revision if attempt is not None else 0
                await self.release(lease, revision)
            elif attempt is not None and attempt.watermark:
                await self._kernel.finish(
                    lease.session_id, lease.epoch, self._runtime_id, attempt.watermark
                )
            else:
                await self._kernel.release(lease.session_id, lease.epoch, self._runtime_id)
        except KeelError as error:
            log.info("session %s was not given back: %s", lease.session_id, error)
            return False
        return True

    async def _owes_work(self, session_id: str) -> bool:
        try:
            view = await self._ledger.get_session(session_id)
        except KeelError:
            return True  # a successor finds out, and does nothing if nothing is owed
        return bool(view.owed_input_seqs or view.open_tool_calls)

    async def release(self, lease: Lease, loadout_revision: int) -> None:
        """Hands a session with work still owed to a successor (audited)."""
        note = HandoffNote(in_flight=self.in_flight, loadout_revision=loadout_revision)
        await self._kernel.release(lease.session_id, lease.epoch, self._runtime_id, handoff=note)

    async def settle_at_boundary(self, attempt: Attempt) -> None:
        """An attempt stopped at a commit boundary by a handoff: a handoff
        if work is still owed, else the attempt is simply done."""
        lease = attempt.lease
        # An attempt can reach its boundary before the drain task has stopped
        # the claim loop (a drain starting at that very boundary): a claim
        # still waiting at the kernel would take the released session back,
        # only to hand it back, and the successor would start an epoch later.
        await self._stop_claiming()
        try:
            if T.owed(attempt.facts, attempt.watermark).nothing:
                await self._kernel.finish(
                    lease.session_id, lease.epoch, self._runtime_id, attempt.watermark
                )
            else:
                await self.release(lease, attempt.loadout.revision)
        except KeelError as error:
            # Fenced or the kernel away: the lease ends when this runtime
            # detaches, or at its TTL.
            log.warning("session %s was not handed back: %s", lease.session_id, error)
