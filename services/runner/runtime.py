"""A runner process working on the sessions it claims, and on those it keeps
between turns (services/runner/intake.py brings both).

Recovery is not a mode here. A lease that comes back `reclaimed` is handled
exactly like a fresh one: the attempt rebuilds from the ledger and does what
is missing. Losing the lease (renewal refused, or a write fenced) stops the
attempt at once, with every task it started, and drops its partials.

Draining (services/runner/drain.py) stops the claim loop and settles or
stops what runs; once a drain has finished, `finished` is set and whoever
runs this runtime replaces it.

Tools: each attempt holds the registry of its tenant's loadout revision from
the runtime's `ToolCatalog` (agent_io.tools.catalog), built under the
operator's policy; the sources of a finished drain, or of a stopped runtime,
are closed (MCP children exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any

from agent_io.loadout import Loadout
from agent_io.providers import (
    ModelConfigError,
    Provider,
    ProviderError,
    provider_from_loadout,
)
from agent_io.tools import ToolCatalog, builtin_tools
from agent_io.tools.factory import SourceFactory, ToolDefaults
from kernel import KernelClient
from kernel.client import Claim
from kernel.domain import DrainMode, FailureKind
from services.blob_parts import BlobContent
from services.blobs import BlobStore, blob_store
from services.common import faults, tracing
from services.common.config import Settings
from services.common.errors import ServiceUnavailable
from services.ledger import LedgerClient
from services.ledger.facts import ATTEMPT_FAILED, CANCELLED, SESSION_PARKED
from services.ledger.packed_facts import facts_from_packed
from services.runner import metrics as runner_metrics
from services.runner.attempt import (
    Attempt,
    AttemptServices,
    CompactionHook,
    Fenced,
    HandoffStop,
    NoCompaction,
    renew_until_lost,
)
from services.runner.config import RunnerConfig
from services.runner.drain import (
    Drainer,
    DrainResult,
    Running,
    cancel_and_wait,
)
from services.runner.events import IDLE, RUNNING
from services.runner.factcache import FactCache, SessionHistory
from services.runner.hub import PartialHub
from services.runner.intake import Intake
from services.runner.outage import once_answered
from services.runner.tool_state import counter_store

log = logging.getLogger("keel.runner")

__all__ = ["DrainResult", "Runtime", "drive"]
CANCEL_WATCH_DELAY_S = 0.1


class Runtime:
    """One runner: claims sessions from the kernel and runs their attempts.

    Owns its ledger and kernel clients, the `Intake` (claim and wake loops),
    the `FactCache` of sessions it has read, the `PartialHub` watchers read
    live deltas from, the tool catalog, the `Drainer` and its Attach stream
    to the kernel; each claimed session runs as an attempt under `drive`.

    Built and served by `services.runner.server.RunnerServer` (the
    `RunnerServicer` answers watch, drain and status calls with it).
    """

    def __init__(
        self,
        config: RunnerConfig,
        settings: Settings,
        address: str = "",
        compaction: CompactionHook | None = None,
    ) -> None:
        self.config = config
        self.settings = settings
        self.runtime_id = config.resolved_runtime_id()
        self.address = address
        self.ledger = LedgerClient(config.ledger_target, settings)
        self.kernel = KernelClient(config.kernel_target, settings)
        self.hub = PartialHub()
        self.compaction: CompactionHook = compaction or NoCompaction()
        self._running: dict[str, Running] = {}
        self._slots = asyncio.Semaphore(config.concurrency)
        # Claims and the wakes of kept sessions (services/runner/intake.py).
        self.intake = Intake(
            self.runtime_id,
            config,
            self.kernel,
            self.hub,
            self._running,
            self._slots,
            lambda: self.drain_mode != DrainMode.NONE,
            self._launch,
        )
        self.fact_cache = FactCache(self.ledger, config.cached_facts, self.intake.evicted)
        self._providers: dict[str, Provider] = {}
        tools = SourceFactory(
            # The counter's effects are kept in the deployment's database:
            # a call redone by another runner must find them (tool_state).
            builtin_tools(counter_store(settings)),
            settings.secrets,
            os.environ,
            ToolDefaults(config.tool_timeout_s, config.tool_max_result_bytes, config.tool_tokens),
            blob_sinks=self._blob_sink,
        )
        self.tool_catalog = ToolCatalog(tools.slots)
        self._close_tools_task: asyncio.Task[None] | None = None
        # Set in start(): opening the store may create its table (blocking).
        self.blobs: BlobContent | None = None
        self._attachment: Any = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._drainer = Drainer(
            self.runtime_id,
            self.kernel,
            self.ledger,
            self._running,
            self._idle,
            self.intake.stop,
            self.intake.start,
        )

    @property
    def drain_mode(self) -> DrainMode:
        return self._drainer.mode

    @property
    def finished(self) -> asyncio.Event:
        """Set once a drain has finished: this runtime must be replaced."""
        return self._drainer.finished

    @property
    def in_flight(self) -> dict[str, asyncio.Task[None]]:
        return {session_id: r.task for session_id, r in self._running.items()}

    @property
    def claiming(self) -> bool:
        return self.drain_mode == DrainMode.NONE and self.intake.claiming

    # -- life cycle --

    async def start(self) -> Runtime:
        # The edge's store (same Settings: the same directory or database),
        # so the model sees what clients uploaded.
        self.blobs = BlobContent(await asyncio.to_thread(blob_store, self.settings))
        await self._register()
        self._attachment = self.kernel.attach(self.runtime_id, reregister=self._register)
        await self._attachment.wait_connected()
        self.intake.start()
        faults.on_drain(self._drain_at_fault_point)
        self._close_tools_task = asyncio.create_task(
            self._close_tools_when_drained(), name="close-tools-when-drained"
        )
        return self

    async def _close_tools_when_drained(self) -> None:
        # However the drain came (a Drain call, SIGTERM, a fault point), no
        # attempt runs once it has finished: tool sources can go.
        await self.finished.wait()
        await self.tool_catalog.aclose()

    def _blob_sink(self, tenant_id: str) -> TenantBlobSink | None:
        return None if self.blobs is None else TenantBlobSink(self.blobs.store, tenant_id)

    def _drain_at_fault_point(self) -> None:
        # Marked draining before returning, so the boundary check that
        # follows the fault point hands the attempt off right there.
        self._drainer.start(DrainMode.HANDOFF, self.settings.lease_ms)

    async def _register(self) -> None:
        await self.kernel.register_runtime(
            self.runtime_id,
            self.address,
            host=socket.gethostname(),
            pid=os.getpid(),
            version="0.1.0",
            role="runner",
        )
        if self.drain_mode != DrainMode.NONE:
            # Registered again after being forgotten: still draining.
            await self.kernel.set_drain(self.runtime_id, self.drain_mode)

    async def stop(self) -> None:
        """Stops claiming and stops in-flight attempts where they are (the
        kernel ends their leases when this runtime detaches)."""
        await self._drainer.close()
        await self.intake.stop()
        await cancel_and_wait([*self.intake.pending(), *(r.task for r in self._running.values())])
        if self._close_tools_task is not None:
            await cancel_and_wait([self._close_tools_task])
        await self.tool_catalog.aclose()
        self.hub.close_all()
        if self._attachment is not None:
            await self._attachment.close()
        for provider in self._providers.values():
            await provider.aclose()
        await self.ledger.close()
        await self.kernel.close()

    async def drain(self, mode: DrainMode | str, deadline_ms: int) -> DrainResult:
        """Stops claiming at once; `handoff` settles in-flight attempts at a
        commit boundary (stopping those still running at the deadline),
        `shutdown` stops them at once. Returns once the drain has finished
        (or was undone): no attempt of this runtime runs any more and every
        lease it held is given back."""
        if mode not in (DrainMode.HANDOFF, DrainMode.SHUTDOWN):
            raise ValueError(mode)
        # Shielded: a caller that goes away does not leave the drain half done.
        return await asyncio.shield(self._drainer.start(DrainMode(mode), deadline_ms))

    async def undrain(self) -> DrainResult:
        """Undoes a drain that has not finished (`finished` in the result
        when it is too late)."""
        return await self._drainer.undo()

    def _launch(self, claim: Claim) -> None:
        """Starts the attempt on a claimed or woken lease (its slot taken)."""
        lease = claim.lease
        self._idle.clear()
        task = asyncio.create_task(self._run(claim), name=f"attempt-{lease.session_id}")
        self._running[lease.session_id] = Running(task, lease)

    async def _run(self, claim: Claim) -> None:
        lease = claim.lease
        granted_ns = time.time_ns()
        log.debug("run %s epoch %d", lease.session_id, lease.epoch)
        try:
            going_on: Claim | None = claim
            while going_on is not None:
                # A turn whose Finish found the next input there already goes
                # on under the same lease (kernel.domain.finish: continued).
                going_on = await self._attempt(going_on, granted_ns)
                granted_ns = time.time_ns()
        except asyncio.CancelledError:
            raise
        except ServiceUnavailable as error:
            # Keel itself is away (services.runner.outage): nothing of the
            # session failed, so no failure is counted and no traceback said;
            # the lease goes back as soon as the kernel answers.
            runner_metrics.attempt_ended("unavailable")
            log.warning("attempt on %s could not start: %s", lease.session_id, error)
            await once_answered(
                lambda: self.kernel.release(lease.session_id, lease.epoch, self.runtime_id),
                self.settings.lease_ms / 1000,
            )
        except Exception as error:
            # Could not even start (the loadout is unreadable, its model
            # misconfigured or refused by the operator's policy): settle as a
            # failed attempt so the kernel backs off, then parks the session,
            # instead of the session waiting for the lease to expire.
            runner_metrics.attempt_ended("not_started")
            if isinstance(error, ModelConfigError):
                log.warning("attempt on %s could not start: %s", lease.session_id, error)
            else:
                log.exception("attempt on %s could not start", lease.session_id)
            with contextlib.suppress(Exception):
                await self.kernel.finish(
                    lease.session_id,
                    lease.epoch,
                    self.runtime_id,
                    read_through=0,
                    failed=True,
                    error=f"attempt could not start: {error}",
                )
        finally:
            if lease.session_id not in self.intake.sticky:
                self.hub.release(lease.session_id)
            self._running.pop(lease.session_id, None)
            self._slots.release()
            if not self._running:
                self._idle.set()

    def _provider(self, tenant_id: str, model: Mapping[str, Any]) -> Provider:
        # Per tenant: a provider holds the key its tenant was granted, and
        # another tenant writing the same model object must not reuse it.
        key = json.dumps([tenant_id, model], sort_keys=True)
        provider = self._providers.get(key)
        if provider is None:
            provider = provider_from_loadout(
                model, tenant_id=tenant_id, secrets=self.settings.secrets
            )
            self._providers[key] = provider
        return provider

    async def _attempt(self, claim: Claim, granted_ns: int) -> Claim | None:
        """One attempt under `claim`'s lease; the claim of the next turn
        when the kernel held the lease on for an input that came first."""
        lease = claim.lease
        services = AttemptServices(
            runtime_id=self.runtime_id,
            ledger=self.ledger,
            kernel=self.kernel,
            hub=self.hub,
            compaction=self.compaction,
            # A shutdown stops attempts anyway; one at a boundary stops there.
            handoff_requested=lambda: self.drain_mode != DrainMode.NONE,
            lease_ms=self.settings.lease_ms,
            blobs=self.blobs,
            max_fact_bytes=self.settings.max_fact_bytes,
        )
        # The claim says which loadout is the latest (the kernel read it in
        # the claim's transaction) and brings its document when this runner
        # has not been sent that revision yet; only a kernel that could not
        # say leaves it to a GetLoadout, fetched alongside the transcript.
        # A wake brings the input it answers: no Read when it follows what
        # the fact cache kept.
        arrived = facts_from_packed(lease.session_id, claim.facts) if claim.facts else []
        if claim.loadout is not None:
            document = claim.loadout
            history = await self.fact_cache.load(lease.session_id, arrived)
        else:
            document, history = await asyncio.gather(
                self.kernel.get_loadout(lease.tenant_id),
                self.fact_cache.load(lease.session_id, arrived),
            )
        loadout = Loadout.from_document(document.revision, document.document)
        provider = self._provider(lease.tenant_id, loadout.model)
        # Held for the attempt: the revision's sources stay open until it ends.
        async with self.tool_catalog.registry(lease.tenant_id, loadout) as tools:
            attempt = Attempt(services, lease, loadout, provider, tools)
            attempt.facts, attempt.parsed = history.facts, history.parsed
            running = self._running.get(lease.session_id)
            if running is not None:
                running.attempt = attempt
            try:
                with _attempt_span(attempt, granted_ns):
                    going_on = await self._work(attempt)
            finally:
                # Whatever the outcome, every fact it holds was committed.
                self.fact_cache.keep(
                    lease.session_id, SessionHistory(attempt.facts, attempt.parsed)
                )
        return Claim(lease, document) if going_on else None

    async def _work(self, attempt: Attempt) -> bool:
        """Drives the attempt and settles it; True when the kernel held the
        lease on for a newer input (the caller goes on with it)."""
        lease = attempt.lease
        work = asyncio.current_task()
        assert work is not None
        lost = False

        def on_lost() -> None:
            nonlocal lost
            lost = True
            work.cancel()

        # Renewals are the lease's business, not the turn's: outside its trace.
        with tracing.detached():
            renewal = asyncio.create_task(
                renew_until_lost(
                    self.kernel, lease, self.runtime_id, self.settings.lease_ms, on_lost
                )
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
            await self._hand_back(attempt)
            return False
        except ProviderError as error:
            runner_metrics.attempt_ended("failed")
            await self._failed(attempt, str(error), failure_kind(error), error.retry_after_ms)
            return False
        except Exception as error:  # a bug must not strand the session
            runner_metrics.attempt_ended("failed")
            log.exception("attempt on %s failed", lease.session_id)
            await self._failed(attempt, f"internal error: {error}", FailureKind.RETRYABLE)
            return False
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
        faults.hit("after_final_before_finish")
        sticky_ms = self.intake.sticky_window()
        with tracing.span("keel.finish", attempt.trace_attributes):
            # The answer is committed: a kernel away for a moment must not
            # leave the session held until the lease's TTL.
            finished = await once_answered(
                lambda: self.kernel.finish(
                    lease.session_id,
                    lease.epoch,
                    self.runtime_id,
                    read_through=attempt.watermark,
                    sticky_ms=sticky_ms,
                ),
                self.settings.lease_ms / 1000,
            )
        runner_metrics.attempt_ended("done")
        log.debug("finished %s epoch %d: %s", lease.session_id, lease.epoch, finished)
        if finished is not None and finished.sticky_until_ms:
            self.intake.sticky.keep(lease, finished.sticky_until_ms)
            attempt.status(IDLE)
        return finished is not None and finished.continued

    async def _hand_back(self, attempt: Attempt) -> None:
        lease = attempt.lease
        await once_answered(
            lambda: self.kernel.release(lease.session_id, lease.epoch, self.runtime_id),
            self.settings.lease_ms / 1000,
        )

    async def _failed(
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
            await self._hand_back(attempt)
            return
        with tracing.span("keel.finish", attempt.trace_attributes, {"keel.failed": True}):
            result = await self.kernel.finish(
                lease.session_id,
                lease.epoch,
                self.runtime_id,
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
            with contextlib.suppress(Fenced):
                await attempt.commit(SESSION_PARKED, {"reason": reason})


@contextlib.contextmanager
def _attempt_span(attempt: Attempt, granted_ns: int) -> Iterator[None]:
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
        finally:
            await cancel_and_wait([work, watch])
        # A client cancelled: the current generation or tool batch has been
        # stopped; let the turn loop settle what the cancel covers.
        await attempt.refresh()


async def _cancel_arrives(attempt: Attempt, seen_cancel: int) -> None:
    after = attempt.facts[-1].seq if attempt.facts else 0
    # Most attempts are over before this: they never open a subscription (a
    # ledger stream, reads on every commit). Nothing is missed by waiting,
    # since the subscription starts from `after`; a cancel only interrupts
    # up to this much later.
    await asyncio.sleep(CANCEL_WATCH_DELAY_S)
    async for fact in attempt.services.ledger.subscribe(attempt.session_id, after):
        if fact.kind == CANCELLED and fact.seq > seen_cancel:
            return


class TenantBlobSink:
    """Where a tool's images and binary resources go: the tenant's blobs,
    which the model is shown like uploads."""

    def __init__(self, store: BlobStore, tenant_id: str) -> None:
        self._store = store
        self._tenant_id = tenant_id

    async def store(self, data: bytes, media_type: str) -> str:
        def write() -> str:
            info = self._store.create(self._tenant_id, len(data), media_type)
            if data:
                self._store.append(self._tenant_id, info.id, 0, data)
            return info.id

        return await asyncio.to_thread(write)
