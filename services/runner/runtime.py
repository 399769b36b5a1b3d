"""A runner process working on the sessions it claims, and on those it keeps
between turns (services/runner/intake.py brings both).

Recovery is not a mode here. A lease that comes back `reclaimed` is handled
exactly like a fresh one: the attempt rebuilds from the ledger and does what
is missing. Losing the lease (renewal refused, or a write fenced) stops the
attempt at once, with every task it started, and drops its partials. How an
attempt runs under its lease and is settled with the kernel is
services/runner/settling.py; this module claims, builds and launches.

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
from collections.abc import Mapping
from typing import Any

from agent_io.loadout import Loadout
from agent_io.providers import ModelConfigError, Provider, provider_from_loadout
from agent_io.tools import ToolCatalog, builtin_tools
from agent_io.tools.factory import SourceFactory, ToolDefaults
from kernel import KernelClient
from kernel.client import Claim
from kernel.domain import DrainMode
from services.blob_parts import BlobContent
from services.blobs import BlobStore, blob_store
from services.common import faults
from services.common.config import Settings
from services.common.errors import ServiceUnavailable
from services.ledger import LedgerClient
from services.ledger.packed_facts import facts_from_packed
from services.runner import metrics as runner_metrics
from services.runner.attempt import Attempt, AttemptServices, CompactionHook, NoCompaction
from services.runner.config import RunnerConfig
from services.runner.drain import (
    Drainer,
    DrainResult,
    Running,
    cancel_and_wait,
)
from services.runner.factcache import FactCache, SessionHistory
from services.runner.hub import PartialHub
from services.runner.intake import Intake
from services.runner.outage import once_answered
from services.runner.settling import AttemptSettler, attempt_span, drive
from services.runner.tool_state import counter_store

log = logging.getLogger(__name__)

__all__ = ["DrainResult", "Runtime", "drive"]


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
        self._settler = AttemptSettler(
            self.runtime_id, self.kernel, settings.lease_ms, self.intake, self._drainer
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
            sticky_window=self.intake.sticky_window,
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
                with attempt_span(attempt, granted_ns):
                    going_on = await self._settler.work(attempt)
            finally:
                # Whatever the outcome, every fact it holds was committed.
                self.fact_cache.keep(
                    lease.session_id, SessionHistory(attempt.facts, attempt.parsed)
                )
        return Claim(lease, document) if going_on else None


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
