"""Running a runner: `keel runner`, `python -m services.runner`, and inside `keel up`."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from services.common.config import Settings
from services.common.serving import RunningServer, serve_services
from services.runner.attempt import CompactionHook
from services.runner.compacting import ServiceCompaction
from services.runner.config import RunnerConfig
from services.runner.runtime import Runtime
from services.runner.servicer import runner_service

if TYPE_CHECKING:
    from compaction.server import CompactionMount

log = logging.getLogger("keel.runner")


class RunnerServer:
    """A runtime (claim loop) plus its gRPC service on one address."""

    def __init__(
        self,
        settings: Settings,
        config: RunnerConfig,
        address: str = "127.0.0.1:0",
        compaction: CompactionHook | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        self.address = address
        self.compaction = compaction
        self.runtime: Runtime | None = None
        self.running: RunningServer | None = None
        self._hook: ServiceCompaction | None = None
        self._embedded: CompactionMount | None = None

    async def start(self) -> RunnerServer:
        # Bind first so the runtime registers the address the edge can reach.
        runtime = Runtime(self.config, self.settings, compaction=self.compaction)
        services = [runner_service(runtime)]
        if self.compaction is None and not self.config.compaction_target:
            # No compaction service given: mount one here and call it over
            # loopback, through the same contract as a separate process.
            # Imported here because compaction.service imports this package.
            from compaction.server import compaction_service

            self._embedded = compaction_service(
                self.settings,
                self.config.ledger_target,
                self.config.kernel_target,
                default_context_window=self.config.default_context_window,
            )
            services.append(self._embedded)
        self.running = await serve_services(services, self.address, self.settings)
        runtime.address = self.running.address
        if self.compaction is None:
            self._hook = ServiceCompaction(
                self.config.compaction_target or self.running.address,
                self.settings,
                default_context_window=self.config.default_context_window,
            )
            runtime.compaction = self._hook
        self.runtime = await runtime.start()
        return self

    @property
    def target(self) -> str:
        assert self.running is not None
        return self.running.address

    @property
    def runtime_id(self) -> str:
        assert self.runtime is not None
        return self.runtime.runtime_id

    async def stop(self, grace: float = 1.0) -> None:
        if self.runtime is not None:
            await self.runtime.stop()
        if self.running is not None:
            await self.running.stop(grace)
        if self._hook is not None:
            await self._hook.close()
        if self._embedded is not None and self._embedded.close is not None:
            await self._embedded.close()


async def run_runner(settings: Settings, config: RunnerConfig, address: str) -> None:
    """Serves until SIGINT/SIGTERM; SIGTERM drains in `config.sigterm_mode`."""
    server = await RunnerServer(settings, config, address).start()
    assert server.runtime is not None
    print(f"runner {server.runtime_id} listening on {server.target}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
        await server.runtime.drain(config.sigterm_mode, config.handoff_deadline_ms)
    finally:
        await server.stop()
