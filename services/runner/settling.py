"""One attempt from its start to its settlement with the kernel.

`drive` runs the attempt's turns and interrupts the current step when a
client cancels; `AttemptSettler` runs it under the lease's renewal and
settles what came of it: a Finish (keeping the session between turns when
asked), a failure recorded in the ledger and reported to the kernel, the
lease handed back during an outage or at a drain's boundary, or nothing at
all when the lease was lost. Apart from the runtime (services/runner/
runtime.py), which claims sessions, builds their attempts and owns the
clients, because this is what happens to one attempt once it exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from agent_io.providers import ProviderError
from kernel import KernelClient
from kernel.domain import FailureKind
from services.common import faults, tracing
from services.common.errors import ServiceUnavailable
from services.ledger.facts import ATTEMPT_FAILED, CANCELLED, INPUT, INTERRUPT, SESSION_PARKED
from services.runner import metrics as runner_metrics
from services.runner import transcript as T
from services.runner.attempt import Attempt, Fenced, HandoffStop, renew_until_lost
from services.runner.drain import Drainer, cancel_and_wait
from services.runner.events import IDLE, RUNNING
from services.runner.intake import Intake
from services.runner.outage import once_answered

# The runtime's logger: what an attempt's end says is the runner's to say.
log = logging.getLogger(__name__)

CANCEL_WATCH_DELAY_S = 0.1


class AttemptSettler:
    """Drives a runtime's attempts and settles each with the kernel."""

    def __init__(
        self,
        runtime_id: str,
        kernel: KernelClient,
        lease_ms: int,
        intake: Intake,
        drainer: Drainer,
    ) -> None:
        self._runtime_id = runtime_id
        self._kernel = kernel
        self._lease_ms = lease_ms
        # Where a finished session is kept between turns (its sticky window).
        self._intake = intake
        # Settles an attempt stopped at a handoff's commit boundary.
        self._drainer = drainer

    async def work(self, attempt: Attempt) -> bool:
        """Drives the attempt and settles it; True when the kernel held the
        lease on for a newer input (the caller goes on with it)."""
        lease = attempt.lease
        work = asyncio.current_task()
        assert work is not None
        lost = False

        def on_lost() -> None:
            nonlocal lost
            if attempt.settled_until_ms:
                # The ledger settled the lease with the final answer: it is
                # kept now, no longer held, and renewals are refused.
                return
            lost = True
            work.cancel()

        # Renewals are the lease's business, not the turn's: outside its trace.
        with tracing.detached():
            renewal = asyncio.create_task(
                renew_until_lost(self._kernel, lease, self._runtime_id, self._lease_ms, on_lost)
            )
        attempt.status(RUNNING)
        try:
            await drive(attempt)
        except asyncio.CancelledError:
            runner_metrics.attempt_ended("lost" if lost else "stopped")
            if lost:
                return False  # a successor owns it; our partials die with us
            raise  # stopped by a drain (which gives the lease back) or by stop()
        except Fenced:
            runner_metrics.attempt_ended("fenced")
            log.info("attempt on %s fenced off by a newer epoch", lease.session_id)
            return False
        except HandoffStop as stop:
            runner_metrics.attempt_ended("handoff")
            log.info("handoff: %s stops at %s", lease.session_id, stop)
            await self._drainer.settle_at_boundary(attempt)
            return False
        except ServiceUnavailable as error:
            # Keel itself is away (services.runner.outage): no failure is
            # counted, and the lease goes back as soon as the kernel answers.
            runner_metrics.attempt_ended("unavailable")
            log.warning("attempt on %s stopped: %s", lease.session_id, error)
            await self.hand_back(attempt)
            return False
        except ProviderError as error:
            runner_metrics.attempt_ended("failed")
            await self.failed(attempt, str(error), failure_kind(error), error.retry_after_ms)
            return False
        except Exception as error:  # a bug must not strand the session
            runner_metrics.attempt_ended("failed")
            log.exception("attempt on %s failed", lease.session_id)
            await self.failed(attempt, f"internal error: {error}", FailureKind.RETRYABLE)
            return False
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
        faults.hit("after_final_before_finish")
        if attempt.settled_until_ms:
            # Finished already, in the final answer's transaction.
            runner_metrics.attempt_ended("done")
            log.debug("settled %s epoch %d with its answer", lease.session_id, lease.epoch)
            self._intake.sticky.keep(lease, attempt.settled_until_ms)
            attempt.status(IDLE)
            return False
        sticky_ms = self._intake.sticky_window()
        with tracing.span("keel.finish", attempt.trace_attributes):
            # The answer is committed: a kernel away for a moment must not
            # leave the session held until the lease's TTL.
            finished = await once_answered(
                lambda: self._kernel.finish(
                    lease.session_id,
                    lease.epoch,
                    self._runtime_id,
                    read_through=attempt.watermark,
                    sticky_ms=sticky_ms,
                ),
                self._lease_ms / 1000,
            )
        runner_metrics.attempt_ended("done")
        log.debug("finished %s epoch %d: %s", lease.session_id, lease.epoch, finished)
        if finished is not None and finished.sticky_until_ms:
            self._intake.sticky.keep(lease, finished.sticky_until_ms)
            attempt.status(IDLE)
        return finished is not None and finished.continued

    async def hand_back(self, attempt: Attempt) -> None:
        lease = attempt.lease
        await once_answered(
            lambda: self._kernel.release(lease.session_id, lease.epoch, self._runtime_id),
            self._lease_ms / 1000,
        )

    async def failed(
        self,
        attempt: Attempt,
        error: str,
        kind: FailureKind,
        retry_after_ms: int | None = None,
    ) -> None:
        """Settles a failed attempt: the ledger says what failed and whether
        it is retried; the kernel decides when, or parks the session (a
        failure that retrying cannot fix parks it at once)."""
        lease = attempt.lease
        rate_limited = kind is FailureKind.RATE_LIMITED
        data: dict[str, Any] = {
            "error": error,
            "retryable": kind is not FailureKind.PERMANENT,
            # Which consecutive one this is, toward its own ceiling.
            "attempt": (lease.rate_limits if rate_limited else lease.failures) + 1,
        }
        if rate_limited:
            data["rateLimited"] = True
        if retry_after_ms is not None:
            data["retryAfterMs"] = retry_after_ms
        try:
            with contextlib.suppress(Fenced):
                await attempt.commit(ATTEMPT_FAILED, data)
        except ServiceUnavailable as away:
            # The failure cannot be recorded now: hand the session back
            # uncounted, as an outage (services.runner.outage) does.
            log.warning("attempt on %s failed during an outage: %s", lease.session_id, away)
            await self.hand_back(attempt)
            return
        with tracing.span("keel.finish", attempt.trace_attributes, {"keel.failed": True}):
            result = await self._kernel.finish(
                lease.session_id,
                lease.epoch,
                self._runtime_id,
                read_through=attempt.watermark,
                failed=True,
                error=error,
                kind=kind,
                retry_after_ms=retry_after_ms or 0,
            )
        if result.parked:
            # The kernel says why (an older kernel does not: the count).
            reason = result.parked_reason or (
                f"gave up after {lease.failures + 1} failed attempts: {error}"
            )
            # The inputs it failed on: what a skip settles, and what a new
            # input is not batched with (services/ledger/domain.py).
            failed_on = T.owed(attempt.facts, attempt.watermark).input_seqs
            parked: dict[str, Any] = {"reason": reason}
            if failed_on:
                parked["inputSeqs"] = list(failed_on)
            with contextlib.suppress(Fenced):
                await attempt.commit(SESSION_PARKED, parked)


@contextlib.contextmanager
def attempt_span(attempt: Attempt, granted_ns: int) -> Iterator[None]:
    """The attempt's span, in the trace of the first input it answers (links
    to the others'), from the moment its lease was granted; its first child
    is the claim: lease granted to transcript and loadout in hand."""
    if not tracing.enabled():
        yield
        return
    parent, links = tracing.turn_parent(attempt.turn_traceparents())
    lease = attempt.lease
    attributes = attempt.trace_attributes
    with tracing.span(
        "keel.attempt", attributes, context=parent, links=links, start_time=granted_ns
    ):
        claim = {
            "keel.lease.failures": lease.failures,
            "keel.runtime_id": attempt.services.runtime_id,
        }
        with tracing.span("keel.claim", attributes, claim, start_time=granted_ns):
            pass
        yield


def failure_kind(error: ProviderError) -> FailureKind:
    """How the kernel should treat a provider's failure."""
    if error.rate_limited:
        return FailureKind.RATE_LIMITED
    return FailureKind.RETRYABLE if error.retryable else FailureKind.PERMANENT


async def drive(attempt: Attempt) -> None:
    """Runs the attempt's turns, interrupting the current step on a cancel.

    The turns run in a task of their own (so a client's cancel can stop the
    current step); whatever ends this coroutine — a lost lease, a drain —
    ends that task too, and waits for it, so no step of the attempt goes on
    committing after the attempt is over."""
    if not await attempt.start():
        return
    # Work is owed: the model is offered every tool of the loadout. Sources
    # are opened and listed here, once per loadout revision (not for a
    # wake-up that finds nothing to do), under the lease renewal.
    await attempt.tools.prepare()
    while True:
        seen_cancel = max((f.seq for f in attempt.facts if f.kind == CANCELLED), default=0)
        work = asyncio.create_task(attempt.run_turns(), name=f"turns-{attempt.session_id}")
        watch = asyncio.create_task(_cancel_arrives(attempt, seen_cancel))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch in done and (failure := watch.exception()) is not None:
                # No way to hear of cancels now: let the turns finish. An
                # outage is said by the attempt it stops (and once per outage).
                away = isinstance(failure, ServiceUnavailable)
                log.log(
                    logging.INFO if away else logging.WARNING,
                    "cancel watch of %s failed: %s",
                    attempt.session_id,
                    failure,
                )
                await asyncio.wait({work})
            if work in done or work.done():
                work.result()
                return
            if watch.result():
                # An input asked to interrupt: the current step stops, what
                # was committed stays, and the attempt ends here. Its Finish
                # sees the newer input, so the next turn (the lease held on,
                # or claimed again) answers the earlier inputs and this one
                # together.
                log.info("attempt on %s interrupted by a new input", attempt.session_id)
                return
        finally:
            await cancel_and_wait([work, watch])
        # A client cancelled: the current generation or tool batch has been
        # stopped; let the turn loop settle what the cancel covers.
        await attempt.refresh()


async def _cancel_arrives(attempt: Attempt, seen_cancel: int) -> bool:
    """Waits for a cancel (False) or an input that interrupts (True)."""
    after = attempt.facts[-1].seq if attempt.facts else 0
    # Most attempts are over before this: they never open a subscription (a
    # ledger stream, reads on every commit). Nothing is missed by waiting,
    # since the subscription starts from `after`; a cancel only interrupts
    # up to this much later.
    await asyncio.sleep(CANCEL_WATCH_DELAY_S)
    async for fact in attempt.services.ledger.subscribe(attempt.session_id, after):
        if fact.kind == CANCELLED and fact.seq > seen_cancel:
            return False
        if fact.kind == INPUT and fact.data.get("multitask") == INTERRUPT:
            return True
    return False
