"""How sessions come to a runner: claimed, or woken while it keeps them.

Two loops feed the runtime's attempts, both within its run slots:

- the claim loop long-polls the kernel for a runnable session; the slot is
  taken before the claim, so a runner never claims more than it can run;
- the wake loop reads the wakes of sessions this runner keeps between turns
  (services/runner/sticky.py, kernel/sticky.py): their leases come held
  again with the epoch they had, and their inputs with them.

A wake whose slot the claim loop holds for its long poll takes that slot
(the claim stays where it is: no withdrawal sent, and a lease it brings
back meanwhile is handed back), since the woken input is here already and
a claim may wait for minutes. A wake that cannot run here now (draining,
every slot busy) is handed back at once, and anyone may claim the session.

Kept sessions are let go (released at the kernel, their hub logs closed)
when the loops stop (a drain, or the runtime stopping) and when the fact
cache evicts their facts (memory pressure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kernel import KernelClient, Lease
from kernel.client import Claim
from services.common.errors import KeelError, ServiceUnavailable
from services.common.outage_log import OutageLog
from services.runner import metrics as runner_metrics
from services.runner.config import RunnerConfig
from services.runner.drain import Running
from services.runner.hub import PartialHub
from services.runner.sticky import StickyHolds

log = logging.getLogger(__name__)

# How long the claim loop waits after a failed claim.
CLAIM_RETRY_S = 0.5
# A kept session let go early waits this long for the kernel's answer (its
# window ends by itself anyway).
LET_GO_TIMEOUT_S = 2.0


class Intake:
    """The claim loop and the wake loop of one runtime."""

    def __init__(
        self,
        runtime_id: str,
        config: RunnerConfig,
        kernel: KernelClient,
        hub: PartialHub,
        running: dict[str, Running],
        slots: asyncio.Semaphore,
        draining: Callable[[], bool],
        launch: Callable[[Claim], None],
    ) -> None:
        self._runtime_id = runtime_id
        self._config = config
        self._kernel = kernel
        self._hub = hub
        self._running = running
        self._slots = slots
        self._draining = draining
        # Starts an attempt on a claim whose slot is taken (the attempt gives
        # the slot back when it ends).
        self._launch = launch
        self.sticky = StickyHolds(self._hold_over)
        self._claim_task: asyncio.Task[None] | None = None
        self._wake_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # The claim loop holds a slot for the claim it is waiting on.
        self._claim_has_slot = False
        self._kernel_outage = OutageLog(log, "kernel", attempts="claims failed")

    @property
    def claiming(self) -> bool:
        return self._claim_task is not None and not self._claim_task.done()

    def start(self) -> None:
        if self._claim_task is None or self._claim_task.done():
            self._claim_task = asyncio.create_task(self._claim_loop(), name="claim-loop")
        if self._wake_task is None or self._wake_task.done():
            self._wake_task = asyncio.create_task(self._wake_loop(), name="wake-loop")

    async def stop(self) -> None:
        for task in (self._claim_task, self._wake_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Kept sessions go at once: their next inputs are claimed elsewhere.
        # (A drain's SetDrain ends their windows at the kernel as well.)
        await asyncio.gather(*(self._let_go(lease) for lease in self.sticky.take_all()))

    def pending(self) -> list[asyncio.Task[None]]:
        """Wakes being started and kept sessions being let go."""
        return list(self._tasks)

    def sticky_window(self) -> int:
        """The window to ask for after an answered turn (0: none): only while
        wakes are read, over a LeaseStream, and not draining."""
        reading = self._wake_task is not None and not self._wake_task.done()
        if self._draining() or not reading or not self._kernel.wakes_can_come:
            return 0
        return self._config.sticky_ms

    def evicted(self, session_id: str) -> None:
        """The fact cache dropped the session's facts: keeping it saves
        nothing any more."""
        lease = self.sticky.take(session_id)
        if lease is not None:
            self._spawn(self._let_go(lease), f"let-go-{session_id}")

    # -- claims --

    async def _claim_loop(self) -> None:
        while True:
            await self._slots.acquire()
            # The slot is the claim's while it long-polls; a wake may borrow
            # it (see _woken), which this loop finds out when it returns.
            self._claim_has_slot = True
            try:
                claim = await self._kernel.claim_with_loadout(
                    self._runtime_id, wait_ms=self._config.claim_wait_ms
                )
            except asyncio.CancelledError:
                self._claim_slot_back()
                raise
            except Exception as error:
                self._claim_slot_back()
                self._claim_failed(error)
                await asyncio.sleep(CLAIM_RETRY_S)
                continue
            self._kernel_outage.succeeded()
            if claim is None:
                self._claim_slot_back()
                continue
            if not self._claim_has_slot:
                # Its slot went to a woken session meanwhile.
                if self._slots.locked():
                    await self.hand_back(claim.lease)
                    continue
                await self._slots.acquire()  # free: no wait
            self._claim_has_slot = False
            if self._draining():
                # Granted while a drain was starting (before the kernel knew
                # of it): handed straight back, never begun.
                self._slots.release()
                await self.hand_back(claim.lease)
                continue
            self._launch(claim)

    def _claim_slot_back(self) -> None:
        if self._claim_has_slot:
            self._claim_has_slot = False
            self._slots.release()

    def _claim_failed(self, error: Exception) -> None:
        """Says why a claim failed, once per outage for a kernel (or its
        database) that is away (services.common.outage_log); a refusal
        without a traceback; anything else, a bug, with its traceback."""
        if isinstance(error, ServiceUnavailable):
            runner_metrics.claim_failed("unavailable")
            self._kernel_outage.failed(error)
        elif isinstance(error, KeelError):
            runner_metrics.claim_failed("refused")
            log.warning("claim refused; retrying: %s", error)
        else:
            runner_metrics.claim_failed("error")
            log.exception("claim failed; retrying")

    async def hand_back(self, lease: Lease) -> None:
        """Gives back a lease never begun."""
        try:
            await self._kernel.release(lease.session_id, lease.epoch, self._runtime_id)
        except KeelError as error:
            log.warning("could not hand back %s: %s", lease.session_id, error)

    # -- wakes --

    async def _wake_loop(self) -> None:
        while True:
            try:
                claim = await self._kernel.next_wake()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug must not end the loop: every later wake would wait
                # out its lease's TTL.
                log.exception("reading a wake failed")
                continue
            log.debug("wake of %s epoch %d", claim.lease.session_id, claim.lease.epoch)
            self._spawn(self._woken(claim), f"wake-{claim.lease.session_id}")

    async def _woken(self, claim: Claim) -> None:
        """Runs a kept session's next turn under its woken lease (same
        epoch); one that cannot run here now is handed back at once."""
        lease = claim.lease
        self.sticky.take(lease.session_id)
        earlier = self._running.get(lease.session_id)
        if earlier is not None:
            # The wake overtook the turn's own end (its Finish answer, or
            # the answer of the append that settled it), which keeps the
            # session again as it ends: this wake ends that hold too.
            await asyncio.wait({earlier.task})
            self.sticky.take(lease.session_id)
        full = self._slots.locked() and not self._claim_has_slot
        if self._draining() or full or lease.session_id in self._running:
            log.debug("wake of %s handed back", lease.session_id)
            self._hub.release(lease.session_id)
            await self.hand_back(lease)
            return
        if self._slots.locked():
            # The last slot is a claim's, long-polling: the woken session,
            # whose input is here already, takes it instead.
            self._claim_has_slot = False
        else:
            await self._slots.acquire()  # free: no wait
        self._launch(claim)

    def _hold_over(self, session_id: str) -> None:
        if session_id not in self._running:
            self._hub.release(session_id)

    async def _let_go(self, lease: Lease) -> None:
        if lease.session_id not in self._running:
            self._hub.release(lease.session_id)
        try:
            await asyncio.wait_for(
                self._kernel.release(lease.session_id, lease.epoch, self._runtime_id),
                LET_GO_TIMEOUT_S,
            )
        except (KeelError, TimeoutError) as error:
            # The window then ends at its time; nothing waits on it.
            log.info("could not let %s go: %s", lease.session_id, error)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
