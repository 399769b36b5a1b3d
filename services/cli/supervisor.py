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
across restarts and listed once everything is up. The internal gRPC ports
are free ones, or B, B+1, … in the same order with `--grpc-base-port B`
(services/cli/up_ports.py).

A child that exits before it is ready ends `keel up` (every child stopped)
with one line: the port it could not listen on, when that is why, rather
than restarting it forever; so does a restarted child whose port was taken
meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field

from services.cli.discovery import remove_discovery, write_discovery
from services.cli.up import (
    UpFailed,
    UpOptions,
    announce,
    announce_grpc,
    bootstrap_tenant,
    stop_signal,
)
from services.cli.up_ports import (
    INTERNAL_HOST,
    free_port,
    internal_ports,
    metrics_host,
    service_names,
)
from services.common.config import Settings
from services.common.internal_auth import TOKEN_ENV
from services.common.metrics_endpoint import METRICS_HOST_ENV, METRICS_PORT_ENV
from services.service_start import NamedPort, PortUnavailable, first_unavailable


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


class ChildFailed(RuntimeError):
    """A child exited before it was ready."""

    def __init__(self, child: Child, code: int | None) -> None:
        self.child = child
        super().__init__(
            f"{child.name} exited with {code} before it was ready; its output is above"
        )


@dataclass
class Child:
    name: str
    args: list[str]
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    metrics_port: int | None = None
    # The ports it listens on: looked at again when it fails to start.
    ports: list[NamedPort] = field(default_factory=list)

    def is_ready_line(self, line: str) -> bool:
        """The line a child prints once it serves: "<service> … listening on
        …" (not a traceback that quotes the code printing it)."""
        return line.startswith(f"{self.args[0]} ") and " listening on " in line


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
        # Why `keel up` stopped on its own (a restarted child could not listen).
        self.failure: PortUnavailable | None = None
        self._stop_event: asyncio.Event | None = None

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
            if not ready.is_set() and child.is_ready_line(line):
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
            raise ChildFailed(child, child.process.returncode)
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
            try:
                await self.wait_ready(child)
            except ChildFailed:
                # Restarting it again would fail again while its port is taken.
                self.failure = first_unavailable(child.ports)
                if self.failure is not None and self._stop_event is not None:
                    self._stop_event.set()
                    return

    def plan(self) -> tuple[list[list[Child]], str]:
        """The children in stages, each started at once once the one before
        is ready (ledgers, kernels, then everything that uses them), and the
        kernel target to bootstrap with."""
        options = self.options
        names = service_names(options.runners, options.ledgers, options.kernels)
        fixed = internal_ports(options.grpc_base_port, names)
        # Chosen once, so a child that is restarted comes back on the same port.
        ports = {name: fixed.get(name) or free_port() for name in names}

        def address(name: str) -> str:
            return f"{INTERNAL_HOST}:{ports[name]}"

        ledger_names = [n for n in names if n.startswith("ledger")]
        kernel_names = [n for n in names if n.startswith("kernel")]
        runner_names = [n for n in names if n.startswith("runner")]
        # Every client reaches every replica through one target: a comma list
        # its channel balances over (services/common/rpc.py balanced_target).
        ledgers = ",".join(map(address, ledger_names))
        kernels = ",".join(map(address, kernel_names))
        # The edge is a child: with port 0 the supervisor picks the port, so
        # the URL it announces (and writes for clients) is the real one.
        grpc_port = options.grpc_port or free_port()
        http_port = options.http_port or free_port()
        self.http_port, self.grpc_port = http_port, grpc_port
        services = ["--ledger", ledgers, "--kernel", kernels]
        ledger_stage = [Child(n, ["ledger", "--address", address(n)]) for n in ledger_names]
        kernel_stage = [
            Child(n, ["kernel", "--address", address(n), "--ledger", ledgers]) for n in kernel_names
        ]
        users = [Child("compaction", ["compaction", "--address", address("compaction"), *services])]
        users += [Child(n, ["runner", *services, "--address", address(n)]) for n in runner_names]
        for child in [*ledger_stage, *kernel_stage, *users]:
            use = f"the internal gRPC port of {child.name}"
            child.ports.append(NamedPort(INTERNAL_HOST, ports[child.name], use, "--grpc-base-port"))
        edge = Child(
            "edge",
            [
                "edge",
                *services,
                *("--compaction", address("compaction"), "--host", options.host),
                *("--http-port", str(http_port), "--grpc-port", str(grpc_port)),
            ],
        )
        edge.ports += [
            NamedPort(options.host, http_port, "the HTTP port", "--http-port"),
            NamedPort(options.host, grpc_port, "the gRPC port", "--grpc-port"),
        ]
        users.append(edge)
        stages = [ledger_stage, kernel_stage, users]
        self._give_metrics_ports([child for stage in stages for child in stage])
        return stages, kernels

    def _give_metrics_ports(self, children: list[Child]) -> None:
        # The order of up_ports's plan: ledgers, kernels, compaction, runners, edge.
        for index, child in enumerate(children):
            port = free_port() if self.metrics_port is None else self.metrics_port + index
            child.metrics_port = port
            child.args += ["--metrics-port", str(port)]
            use = f"the metrics port of {child.name}"
            child.ports.append(NamedPort(metrics_host(), port, use, "--metrics-port"))

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
                    kernels,
                    self.settings,
                    self.options.dev_key,
                    self.options.model,
                    data_dir=self.settings.data_dir,
                )
        return key

    async def run(self) -> None:
        stages, kernels = self.plan()
        # Listened for from the start: a SIGTERM while children are still
        # starting must stop them too, not leave them running orphaned.
        stop = self._stop_event = stop_signal()
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
            try:
                key = startup.result()
            except ChildFailed as failed:
                raise first_unavailable(failed.child.ports) or UpFailed(str(failed)) from None
            url = f"http://{self.options.host}:{self.http_port}"
            grpc_address = f"{self.options.host}:{self.grpc_port}"
            # Clients find it before "Keel is up" sends anyone to them.
            write_discovery(self.settings.data_dir, url, grpc_address)
            announce_grpc(grpc_address)
            self.announce_metrics()
            announce(url, key, self.options.model)
            await stopped
            if self.failure is not None:
                raise self.failure
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
