"""Running a runner: `keel runner`, `python -m services.runner`, and inside `keel up`.

A runner registers with the kernel the address others dial to reach it: the
address it listens on, or `advertise_address` when that differs (a wildcard
bind such as 0.0.0.0 must name one: registering 127.0.0.1 would send every
edge to itself). It also records itself under the data dir for `keel drain
--local` (services/common/runtime_records.py).

Before anything else a runner protects its secrets from the MCP servers it
will start (`protect_secrets_from_tools`).

A standalone runner exits 0 once a drain has finished: it is replaced (a
new pod, a new child of `keel up --processes`), never revived.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from agent_io.tools import child_sandbox
from compaction.server import CompactionMount, compaction_service
from services.common.config import Settings
from services.common.runtime_records import (
    forget_runtime,
    is_wildcard,
    local_dial_address,
    record_runtime,
    split_host_port,
)
from services.common.serving import RunningServer, serve_services
from services.runner.attempt import CompactionHook
from services.runner.compacting import ServiceCompaction
from services.runner.config import RunnerConfig
from services.runner.runtime import Runtime
from services.runner.servicer import runner_service

log = logging.getLogger(__name__)


def check_addresses(address: str, advertise: str = "") -> None:
    """Raises ValueError (one line saying what to do) when `address` is not
    host:port, or is a wildcard with nothing to advertise instead."""
    try:
        host, _ = split_host_port(address)
    except ValueError:
        raise ValueError(f"--address {address!r}: expected host:port") from None
    if is_wildcard(host) and not advertise:
        raise ValueError(
            f"--address {address} listens on every interface: also give "
            "--advertise-address (or KEEL_ADVERTISE_ADDRESS), the host:port other "
            "services dial to reach this runner, e.g. the pod's IP"
        )
    if advertise and ":" in advertise.rpartition("]")[2]:
        try:
            advertised_host, _ = split_host_port(advertise)
        except ValueError:
            advertised_host = ""
        if not advertised_host or is_wildcard(advertised_host):
            raise ValueError(f"--advertise-address {advertise!r}: expected host or host:port")
    elif advertise and is_wildcard(advertise):
        raise ValueError(f"--advertise-address {advertise!r}: a wildcard cannot be dialled")


def advertised_address(address: str, port: int, advertise: str = "") -> str:
    """What the kernel is told: `advertise` (its port defaulting to the
    bound one), else the host listened on with the bound port."""
    check_addresses(address, advertise)
    if advertise:
        try:
            host, advertised_port = split_host_port(advertise)
        except ValueError:  # a host alone ("10.0.0.5", "[fd00::5]")
            host, advertised_port = advertise, 0
        return f"{host}:{advertised_port or port}"
    host, _ = split_host_port(address)
    return f"{host}:{port}"


def protect_secrets_from_tools(settings: Settings) -> None:
    """Before any tool server starts: this process becomes undumpable and MCP
    stdio servers start in a sandbox that hides the data dir and the TLS key
    (agent_io.tools.child_sandbox). Process-wide, so it holds for a runner
    inside `keel up` too."""
    masks: list[str | os.PathLike[str]] = [settings.data_dir]
    if settings.grpc_tls_key:
        masks.append(settings.grpc_tls_key)
    child_sandbox.configure(child_sandbox.SandboxPolicy.from_env(os.environ, masks))


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
        self._record: Path | None = None
        # The registered address, and how this host dials the server.
        self._advertised = ""
        self._local = ""

    async def start(self) -> RunnerServer:
        check_addresses(self.address, self.config.advertise_address)
        protect_secrets_from_tools(self.settings)
        # Bind first so the runtime registers the address the edge can reach.
        runtime = Runtime(self.config, self.settings, compaction=self.compaction)
        services = [runner_service(runtime)]
        if self.compaction is None and not self.config.compaction_target:
            # No compaction service given: mount one here and call it over
            # loopback, through the same contract as a separate process.
            self._embedded = compaction_service(
                self.settings,
                self.config.ledger_target,
                self.config.kernel_target,
                default_context_window=self.config.default_context_window,
            )
            services.append(self._embedded)
        self.running = await serve_services(services, self.address, self.settings)
        port = self.running.port
        self._advertised = advertised_address(self.address, port, self.config.advertise_address)
        self._local = local_dial_address(split_host_port(self.address)[0], port)
        runtime.address = self._advertised
        if self.compaction is None:
            # The embedded service is dialled where it listens, which the
            # advertised address (another interface, a NAT) may not be.
            self._hook = ServiceCompaction(
                self.config.compaction_target or self._local,
                self.settings,
                default_context_window=self.config.default_context_window,
            )
            runtime.compaction = self._hook
        self.runtime = await runtime.start()
        self._record = record_runtime(
            self.settings.data_dir, runtime.runtime_id, "runner", self._local
        )
        return self

    @property
    def target(self) -> str:
        """The address registered with the kernel (where edges dial)."""
        assert self.running is not None
        return self._advertised

    @property
    def runtime_id(self) -> str:
        assert self.runtime is not None
        return self.runtime.runtime_id

    async def stop(self, grace: float = 1.0) -> None:
        if self._record is not None:
            forget_runtime(self._record)
        if self.runtime is not None:
            await self.runtime.stop()
        if self.running is not None:
            await self.running.stop(grace)
        if self._hook is not None:
            await self._hook.close()
        if self._embedded is not None and self._embedded.close is not None:
            await self._embedded.close()


async def run_runner(settings: Settings, config: RunnerConfig, address: str) -> None:
    """Serves until a drain has finished (then exits 0: the runner is
    replaced) or SIGINT/SIGTERM, which drains in `config.sigterm_mode` first."""
    server = await RunnerServer(settings, config, address).start()
    runtime = server.runtime
    assert runtime is not None
    print(f"runner {server.runtime_id} listening on {server.target}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        signalled = asyncio.ensure_future(stop.wait())
        drained = asyncio.ensure_future(runtime.finished.wait())
        try:
            await asyncio.wait({signalled, drained}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (signalled, drained):
                waiter.cancel()
        if not runtime.finished.is_set():
            await runtime.drain(config.sigterm_mode, config.handoff_deadline_ms)
        print(f"runner {server.runtime_id} drained; exiting", flush=True)
    finally:
        await server.stop()
