"""`keel up`: every service, one command.

Embedded (default): ledger, kernel, compaction, runner and edge in this
process, each on its own loopback gRPC port and talking through the same
contracts as in production. `--processes`: each service as its own OS process
under a small supervisor that restarts a child that dies (runners there embed
their own compaction service; the edge asks the compaction process for
contexts).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from compaction.server import CompactionServer
from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from kernel import KernelClient, KernelServer
from services.common.config import Settings
from services.ledger import LedgerServer
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class UpOptions:
    http_port: int = 8080
    host: str = "127.0.0.1"
    processes: bool = False
    runners: int = 1
    dev_key: str = ""


async def bootstrap_tenant(kernel_target: str, settings: Settings, dev_key: str) -> str:
    """The default tenant and a dev key (fixed by KEEL_DEV_KEY) that is its
    admin and an operator: one developer runs the whole deployment."""
    key = dev_key or f"keel-dev-{secrets.token_urlsafe(18)}"
    async with KernelClient(kernel_target, settings) as kernel:
        await kernel.create_tenant(DEFAULT_TENANT, "Default tenant")
        await kernel.create_api_key(DEFAULT_TENANT, key, admin=True, operator=True)
    return key


def _announce(url: str, key: str) -> None:
    print(f"Keel is up: {url}/#key={key}", flush=True)
    print(f"  dev key (admin of tenant {DEFAULT_TENANT!r}, operator): {key}", flush=True)
    print(f"  try: curl -H 'Authorization: Bearer <key>' -X POST {url}/v1/sessions", flush=True)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()


async def up_embedded(settings: Settings, options: UpOptions) -> None:
    ledger = await LedgerServer(settings).start()
    kernel = await KernelServer(settings, ledger_target=ledger.target).start()
    runner_config = RunnerConfig.from_env(ledger.target, kernel.target)
    # One compaction service for the runners and the edge (/context), unless
    # KEEL_COMPACTION_ADDRESS names one elsewhere.
    compaction: CompactionServer | None = None
    if not runner_config.compaction_target:
        compaction = await CompactionServer(
            settings,
            ledger.target,
            kernel.target,
            default_context_window=runner_config.default_context_window,
        ).start()
        runner_config = replace(runner_config, compaction_target=compaction.target)
    runners = [
        await RunnerServer(settings, runner_config).start() for _ in range(max(options.runners, 1))
    ]
    edge = await EdgeServer(
        settings,
        EdgeConfig(ledger.target, kernel.target, runner_config.compaction_target),
        options.host,
        options.http_port,
    ).start()
    assert edge.gateway is not None
    edge.gateway.local_runtime_ids.update(r.runtime_id for r in runners)
    key = await bootstrap_tenant(kernel.target, settings, options.dev_key)
    _announce(f"http://{options.host}:{edge.port}", key)
    try:
        await _wait_for_signal()
        print("draining: in-flight runs settle at a commit boundary…", flush=True)
        for runner in runners:
            assert runner.runtime is not None
            await runner.runtime.drain("handoff", 10_000)
    finally:
        await edge.stop()
        for runner in runners:
            await runner.stop()
        if compaction is not None:
            await compaction.stop()
        await kernel.stop()
        await ledger.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Child:
    name: str
    args: list[str]
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    output: list[str] = field(default_factory=list)


class Supervisor:
    """Starts each service as a child, restarts any that dies, stops them all."""

    def __init__(self, settings: Settings, options: UpOptions) -> None:
        self.settings = settings
        self.options = options
        self.children: list[Child] = []
        self._stopping = False
        self._readers: set[asyncio.Task[None]] = set()

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "KEEL_DATABASE_URL": self.settings.database_url,
                "KEEL_DATA_DIR": str(self.settings.data_dir),
                "KEEL_PG_SCHEMA": self.settings.pg_schema,
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    async def spawn(self, child: Child) -> None:
        child.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.cli.main",
            *child.args,
            env=self.env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        print(f"  {child.name}: pid {child.process.pid}", flush=True)

    async def wait_ready(self, child: Child, marker: str) -> None:
        assert child.process is not None and child.process.stdout is not None
        while True:
            line = await child.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{child.name} exited before it was ready")
            if marker in line.decode(errors="replace"):
                # Keep reading so a chatty child never blocks on a full pipe.
                self._readers.add(asyncio.create_task(self._drain_output(child)))
                return

    async def _drain_output(self, child: Child) -> None:
        assert child.process is not None and child.process.stdout is not None
        async for _ in child.process.stdout:
            pass

    async def keep_alive(self, child: Child, marker: str) -> None:
        while not self._stopping:
            assert child.process is not None
            code = await child.process.wait()
            if self._stopping:
                return
            child.restarts += 1
            print(
                f"  {child.name} (pid {child.process.pid}) exited with {code}; restarting",
                flush=True,
            )
            await self.spawn(child)
            with contextlib.suppress(RuntimeError):
                await self.wait_ready(child, marker)

    async def run(self) -> None:
        ledger_addr = f"127.0.0.1:{_free_port()}"
        kernel_addr = f"127.0.0.1:{_free_port()}"
        compaction_addr = f"127.0.0.1:{_free_port()}"
        plan = [
            (Child("ledger", ["ledger", "--address", ledger_addr]), "listening on"),
            (
                Child("kernel", ["kernel", "--address", kernel_addr, "--ledger", ledger_addr]),
                "listening on",
            ),
            (
                Child(
                    "compaction",
                    [
                        "compaction",
                        "--address",
                        compaction_addr,
                        "--ledger",
                        ledger_addr,
                        "--kernel",
                        kernel_addr,
                    ],
                ),
                "listening on",
            ),
        ]
        plan += [
            (
                Child(
                    f"runner-{i + 1}", ["runner", "--ledger", ledger_addr, "--kernel", kernel_addr]
                ),
                "listening on",
            )
            for i in range(max(self.options.runners, 1))
        ]
        plan.append(
            (
                Child(
                    "edge",
                    [
                        "edge",
                        "--ledger",
                        ledger_addr,
                        "--kernel",
                        kernel_addr,
                        "--compaction",
                        compaction_addr,
                        "--host",
                        self.options.host,
                        "--http-port",
                        str(self.options.http_port),
                    ],
                ),
                "listening on",
            )
        )
        print("starting Keel as separate processes:", flush=True)
        watchers: list[asyncio.Task[None]] = []
        try:
            for child, marker in plan:
                self.children.append(child)
                await self.spawn(child)
                await self.wait_ready(child, marker)
                if child.name == "kernel":
                    key = await bootstrap_tenant(kernel_addr, self.settings, self.options.dev_key)
                watchers.append(asyncio.create_task(self.keep_alive(child, marker)))
            _announce(f"http://{self.options.host}:{self.options.http_port}", key)
            await _wait_for_signal()
        finally:
            self._stopping = True
            for child in reversed(self.children):
                if child.process is not None and child.process.returncode is None:
                    child.process.send_signal(signal.SIGTERM)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(child.process.wait(), 15)
                    if child.process.returncode is None:
                        child.process.kill()
                        await child.process.wait()
            for watcher in watchers:
                watcher.cancel()


def data_dir_settings(settings: Settings, data_dir: Path | None) -> Settings:
    if data_dir is not None:
        settings = settings.with_overrides(data_dir=data_dir)
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    return settings
