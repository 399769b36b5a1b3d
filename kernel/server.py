"""Running the kernel service: `keel kernel`, and embedded in `keel up`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from kernel.client import KernelClient
from kernel.config import KernelConfig
from kernel.database import Database
from kernel.expiry import Attachments, RuntimePruner, Sweeper
from kernel.liveness import Heartbeats, LivenessStore
from kernel.metrics import KernelMetrics
from kernel.reconcile import Reconciler
from kernel.registry import RegistryStore
from kernel.schedule_store import ScheduleStore
from kernel.scheduler import Scheduler
from kernel.schedules import Schedule
from kernel.servicer import KernelServicer, kernel_service
from kernel.store import LeaseStore
from kernel.tenancy import TenantStore
from kernel.waker import ClaimWaker
from services.common.config import Settings
from services.common.errors import KeelError
from services.common.serving import RunningServer, serve_services
from services.ledger.client import LedgerClient
from services.ledger.facts import INPUT

log = logging.getLogger(__name__)


class KernelServer:
    """The kernel's stores served over gRPC on one address.

    With `ledger_target`, it also reconciles its queue with the ledger's
    owing sessions (at start-up and every `config.reconcile_ms`).
    """

    def __init__(
        self,
        settings: Settings,
        address: str = "127.0.0.1:0",
        ledger_target: str | None = None,
        *,
        config: KernelConfig | None = None,
    ) -> None:
        self.settings = settings
        self.address = address
        self.ledger_target = ledger_target
        self.config = config or KernelConfig.from_env()
        self.waker = ClaimWaker()
        self.metrics = KernelMetrics()
        self.database: Database | None = None
        self.leases: LeaseStore | None = None
        self.registry: RegistryStore | None = None
        self.tenants: TenantStore | None = None
        self.attachments: Attachments | None = None
        self.liveness: LivenessStore | None = None
        self.heartbeats: Heartbeats | None = None
        self.servicer: KernelServicer | None = None
        self.reconciler: Reconciler | None = None
        # Scheduled inputs (kernel/scheduler.py): fired only where the
        # ledger is known, with a ledger client and a client of this kernel.
        self.schedules: ScheduleStore | None = None
        self.scheduler: Scheduler | None = None
        self._firing: tuple[LedgerClient, KernelClient] | None = None
        self.running: RunningServer | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> KernelServer:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        self.waker.bind(asyncio.get_running_loop())
        self.database = await asyncio.to_thread(Database, self.settings)
        self.leases = LeaseStore(
            self.database,
            self.settings.lease_ms,
            self.config.retry_policy,
            self.metrics,
            on_change=self.waker.wake,
        )
        # Read only when a metrics reader asks (a scrape): no cost otherwise.
        self.metrics.observe_queue(self.leases.queue_depth)
        self.registry = RegistryStore(self.database)
        self.tenants = TenantStore(self.database)
        # Counters change with their leases, so this should find nothing;
        # it guarantees a slot is never leaked across a restart regardless.
        await asyncio.to_thread(self.leases.reconcile_slots)
        self.attachments = Attachments(self.leases, self.registry, self.config.attach_heartbeat_ms)
        self.schedules = ScheduleStore(self.database)
        self.servicer = KernelServicer(
            self.leases,
            self.registry,
            self.tenants,
            self.attachments,
            self.waker,
            self.config,
            secrets=self.settings.secrets,
            schedules=self.schedules,
        )
        self.running = await serve_services(
            [kernel_service(self.servicer)], self.address, self.settings
        )
        self.liveness = LivenessStore(self.database, self.leases)
        # A restarted `keel up`: its predecessor's runners are gone now.
        try:
            gone = await asyncio.to_thread(
                self.liveness.bury_gone_processes, self.settings.data_dir
            )
        except KeelError as error:
            log.warning("could not free the sessions of gone runtimes: %s", error)
            gone = {}
        for runtime_id, freed in gone.items():
            if freed:
                log.info("runtime %s is gone; expired %d lease(s)", runtime_id, len(freed))
        self.heartbeats = Heartbeats(
            self.liveness,
            self.attachments.runtime_ids,
            self.config.runtime_heartbeat_ms,
            self.config.runtime_dead_after_ms,
        )
        self._spawn(self.heartbeats.run(), "kernel-heartbeats")
        sweeper = Sweeper(self.leases, self.config.sweep_interval_ms(self.settings.lease_ms))
        self._spawn(sweeper.run(), "kernel-sweeper")
        pruner = RuntimePruner(
            self.registry, self.config.runtime_retention_ms, self.config.prune_interval_ms
        )
        self._spawn(pruner.run(), "kernel-runtime-pruner")
        if self.ledger_target:
            self.reconciler = Reconciler(
                self.leases,
                self.ledger_target,
                self.settings,
                self.config.reconcile_ms,
                self.config.reconcile_grace_ms,
            )
            self._spawn(self.reconciler.run(), "kernel-reconciler")
            self._firing = (
                LedgerClient(self.ledger_target, self.settings),
                KernelClient(self.target, self.settings),
            )
            self.scheduler = Scheduler(self.schedules, self._fire, self.config.schedule_tick_ms)
            self._spawn(self.scheduler.run(), "kernel-scheduler")

    async def _fire(self, schedule: Schedule, request_id: str) -> None:
        """A due schedule's input, committed as the edge commits one, and its
        session woken (through this kernel's own API, so a runner keeping
        the session gets the wake)."""
        assert self._firing is not None
        ledger, kernel = self._firing
        data = {"text": schedule.text, "requestId": request_id}
        appended = await ledger.append_one(schedule.session_id, INPUT, data)
        await kernel.enqueue(schedule.session_id, schedule.tenant_id, input_seq=appended.seq)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(work, name=name))

    @property
    def target(self) -> str:
        assert self.running is not None
        return self.running.address

    async def stop(self, grace: float = 2.0) -> None:
        if self.running is not None:
            # Drains first: Attach streams end without expiring anything.
            await self.running.stop(grace)
            self.running = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.servicer is not None:
            await self.servicer.close()
        if self.attachments is not None:
            await self.attachments.close()
        if self.reconciler is not None:
            await self.reconciler.close()
            self.reconciler = None
        if self._firing is not None:
            for client in self._firing:
                await client.close()
            self._firing = None
        if self.database is not None:
            await asyncio.to_thread(self.database.close)
            self.database = None


async def run_kernel(settings: Settings, address: str, ledger_target: str | None = None) -> None:
    """Serves until cancelled (SIGINT/SIGTERM), then drains."""
    server = await KernelServer(settings, address, ledger_target).start()
    log.info("kernel listening on %s", server.target)
    print(f"kernel listening on {server.target}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
