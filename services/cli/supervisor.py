"""`keel up --processes`: each service its own OS process under a supervisor.

The supervisor starts the children in stages (the ledgers, then the
kernels, then the compaction service, the runners and the edge, which use
them), restarts any child that dies on the same address, and stops them all
in reverse order. `--ledgers N` / `--kernels N` start replicas: every client
gets all of a service's addresses as one comma list, which its channel
balances over (services/common/rpc.py `balanced_target`), so a replica's
death only fails the calls in flight on it.

Every line a child prints is passed on with its name and pid, and the
supervisor says when a child starts, is ready and exits:

    ledger-2: pid 4242
    [ledger-2 4242] ledger listening on 127.0.0.1:7111
    ledger-2 (pid 4242) is ready
    ledger-2 (pid 4242) exited with -9; restarting

Every child serves its own Prometheus metrics on a loopback port the
supervisor chooses (`--metrics-port P`: P, P+1, … in start order), kept
across restarts and listed once everything is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from dataclasses import dataclass, field

from services.cli.discovery import remove_discovery, write_discovery
from services.cli.up import UpOptions, announce, announce_grpc, bootstrap_tenant, stop_signal
from services.common.config import Settings
from services.common.internal_auth import TOKEN_ENV
from services.common.metrics_endpoint import METRICS_HOST_ENV, METRICS_PORT_ENV


def replica_refusal(options: UpOptions, settings: Settings) -> str | None:
    """Why `options` cannot run as asked, or None.

    Replicas share one database and must see each other's commits as they
    happen: a ledger wakes its subscribers on PostgreSQL's NOTIFY, and the
    kernel's claim wake-ups and row locks are PostgreSQL's too. On SQLite a
    second replica would serve stale streams, so it is refused."""
    if options.ledgers < 1 or options.kernels < 1:
        return "--ledgers and --kernels must be at least 1"
    if options.ledgers == 1 and options.kernels == 1:
        return None
    if not options.processes:
        return "--ledgers/--kernels above 1 need --processes"
    if not settings.uses_postgres:
        return (
            "--ledgers/--kernels above 1 need PostgreSQL (--database-url or "
            "KEEL_DATABASE_URL): replicas on SQLite files would not see each other's commits"
        )
    return None


def _replica_names(service: str, count: int) -> list[str]:
    # One replica keeps the plain name that scripts and logs already know.
    return [service] if count == 1 else [f"{service}-{i + 1}" for i in range(count)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Child:
    name: str
    args: list[str]
    process: asyncio.subprocess.Process | None = None
    # The line a child prints once it serves.
    marker: str = "listening on"
    restarts: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    metrics_port: int | None = None


class Supervisor:
    """Starts each service as a child, restarts any that dies, stops them all.

    Every line a child prints is passed on, prefixed with its name and pid
    (`[ledger-2 4242] …`), so a lease lost, a fenced write or a broken
    connection in any service shows in `keel up`'s own output."""

    def __init__(
        self, settings: Settings, options: UpOptions, metrics_port: int | None = None
    ) -> None:
        self.settings = settings
        self.options = options
        # The first child's metrics port (the next ones follow), or None: free ports.
        self.metrics_port = metrics_port
        self.children: list[Child] = []
        self._stopping = False
        self._readers: set[asyncio.Task[None]] = set()
        self._output_closed = False
        self.http_port = options.http_port
        self.grpc_port = options.grpc_port

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "KEEL_DATABASE_URL": self.settings.database_url,
                "KEEL_DATA_DIR": str(self.settings.data_dir),
                "KEEL_PG_SCHEMA": self.settings.pg_schema,
                # Every child checks and sends the same token (made per data dir).
                TOKEN_ENV: self.settings.internal_token,
                # Every child listens on loopback: nothing else to advertise.
                "KEEL_ADVERTISE_ADDRESS": "",
                **self.settings.secrets.to_env(),
                "PYTHONUNBUFFERED": "1",
                # Each child's port comes as its --metrics-port flag.
                METRICS_HOST_ENV: "127.0.0.1",
            }
        )
        env.pop(METRICS_PORT_ENV, None)
        return env

    async def spawn(self, child: Child) -> None:
        child.ready = asyncio.Event()
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
        # Read to the end, so a chatty child never blocks on a full pipe.
        reader = asyncio.create_task(self._forward_output(child, child.process, child.ready))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)

    async def _forward_output(
        self, child: Child, process: asyncio.subprocess.Process, ready: asyncio.Event
    ) -> None:
        assert process.stdout is not None
        prefix = f"[{child.name} {process.pid}]"
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if not self._output_closed:
                try:
                    print(f"{prefix} {line}", flush=True)
                except OSError:
                    # Nobody reads `keel up` any more: keep draining the
                    # child's pipe (a full one would block it) in silence.
                    self._output_closed = True
            if not ready.is_set() and child.marker in line:
                ready.set()

    async def wait_ready(self, child: Child) -> None:
        """Returns once `child` printed its marker; raises if it exits first."""
        assert child.process is not None
        ready = asyncio.ensure_future(child.ready.wait())
        exited = asyncio.ensure_future(child.process.wait())
        try:
            await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            exited.cancel()
        if not child.ready.is_set():
            raise RuntimeError(f"{child.name} exited before it was ready")
        print(f"  {child.name} (pid {child.process.pid}) is ready", flush=True)

    async def keep_alive(self, child: Child) -> None:
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
                await self.wait_ready(child)

    def plan(self) -> tuple[list[list[Child]], str]:
        """The children in stages, each started at once once the one before
        is ready (ledgers, kernels, then everything that uses them), and the
        kernel target to bootstrap with."""
        ledger_addrs = [f"127.0.0.1:{_free_port()}" for _ in range(self.options.ledgers)]
        kernel_addrs = [f"127.0.0.1:{_free_port()}" for _ in range(self.options.kernels)]
        compaction_addr = f"127.0.0.1:{_free_port()}"
        # Every client reaches every replica through one target: a comma list
        # its channel balances over (services/common/rpc.py balanced_target).
        ledgers = ",".join(ledger_addrs)
        kernels = ",".join(kernel_addrs)
        # Chosen once, so an edge that is restarted comes back on the same port.
        grpc_port = self.options.grpc_port or _free_port()
        # The edge is a child: with port 0 the supervisor picks the port, so
        # the URL it announces (and writes for clients) is the real one.
        http_port = self.options.http_port or _free_port()
        self.http_port, self.grpc_port = http_port, grpc_port
        ledger_stage = [
            Child(name, ["ledger", "--address", address])
            for name, address in zip(
                _replica_names("ledger", len(ledger_addrs)), ledger_addrs, strict=True
            )
        ]
        kernel_stage = [
            Child(name, ["kernel", "--address", address, "--ledger", ledgers])
            for name, address in zip(
                _replica_names("kernel", len(kernel_addrs)), kernel_addrs, strict=True
            )
        ]
        services = ["--ledger", ledgers, "--kernel", kernels]
        users = [Child("compaction", ["compaction", "--address", compaction_addr, *services])]
        users += [
            Child(f"runner-{i + 1}", ["runner", *services])
            for i in range(max(self.options.runners, 1))
        ]
        users.append(
            Child(
                "edge",
                [
                    "edge",
                    *services,
                    *("--compaction", compaction_addr, "--host", self.options.host),
                    *("--http-port", str(http_port), "--grpc-port", str(grpc_port)),
                ],
            )
        )
        stages = [ledger_stage, kernel_stage, users]
        self._give_metrics_ports([child for stage in stages for child in stage])
        return stages, kernels

    def _give_metrics_ports(self, children: list[Child]) -> None:
        for index, child in enumerate(children):
            port = _free_port() if self.metrics_port is None else self.metrics_port + index
            child.metrics_port = port
            child.args += ["--metrics-port", str(port)]

    def announce_metrics(self) -> None:
        print("metrics (Prometheus text, one port per process):", flush=True)
        for child in self.children:
            print(f"  {child.name}: http://127.0.0.1:{child.metrics_port}/metrics", flush=True)

    async def _start(self, child: Child) -> None:
        self.children.append(child)
        await self.spawn(child)
        await self.wait_ready(child)

    async def _stop(self, child: Child) -> None:
        if child.process is None or child.process.returncode is not None:
            return
        child.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.process.wait(), 15)
        if child.process.returncode is None:
            child.process.kill()
            await child.process.wait()

    async def _start_stages(
        self, stages: list[list[Child]], kernels: str, watchers: list[asyncio.Task[None]]
    ) -> str:
        """Starts every stage in turn; returns the dev key."""
        key = ""
        for stage in stages:
            await asyncio.gather(*(self._start(child) for child in stage))
            watchers += [asyncio.create_task(self.keep_alive(child)) for child in stage]
            if stage is stages[1]:
                key = await bootstrap_tenant(
                    kernels, self.settings, self.options.dev_key, self.options.model
                )
        return key

    async def run(self) -> None:
        stages, kernels = self.plan()
        # Listened for from the start: a SIGTERM while children are still
        # starting must stop them too, not leave them running orphaned.
        stop = stop_signal()
        print("starting Keel as separate processes:", flush=True)
        watchers: list[asyncio.Task[None]] = []
        startup = asyncio.ensure_future(self._start_stages(stages, kernels, watchers))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({startup, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not startup.done():
                startup.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await startup
                return
            key = startup.result()
            url = f"http://{self.options.host}:{self.http_port}"
            grpc_address = f"{self.options.host}:{self.grpc_port}"
            announce_grpc(grpc_address)
            self.announce_metrics()
            announce(url, key, self.options.model)
            write_discovery(self.settings.data_dir, url, grpc_address)
            await stopped
        finally:
            stopped.cancel()
            remove_discovery(self.settings.data_dir)
            self._stopping = True
            # Stage by stage, last first: runners hand their sessions back
            # through the kernels and ledgers, which stop after them.
            for stage in reversed(stages):
                await asyncio.gather(*(self._stop(child) for child in stage))
            for watcher in watchers:
                watcher.cancel()
            # What the children printed last (why they stopped) is shown too.
            if self._readers:
                await asyncio.wait(set(self._readers), timeout=2)
