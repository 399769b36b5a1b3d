"""A real Keel cluster for runner, edge and tool tests.

The ledger and kernel run in the test's process (real gRPC servers on
loopback); runners are real OS processes that tests SIGKILL, SIGSTOP or drain.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from kernel import KernelClient, KernelConfig, KernelServer
from services.common.config import Settings
from services.ledger import CommittedFact, LedgerClient, LedgerServer
from services.ledger.domain import SessionView
from services.ledger.packed_facts import pack_input
from tests.support.databases import settings_env
from tests.support.polling import eventually
from tests.support.processes import ChildProcess


@dataclass
class Cluster:
    settings: Settings
    ledger_server: LedgerServer
    kernel_server: KernelServer
    ledger: LedgerClient
    kernel: KernelClient
    runners: list[ChildProcess] = field(default_factory=list)

    def start_runner(self, **env: str) -> ChildProcess:
        child_env = settings_env(self.settings)
        child_env.update(env)
        runner = ChildProcess.python(
            "-m",
            "services.runner",
            "--ledger",
            self.ledger_server.target,
            "--kernel",
            self.kernel_server.target,
            env=child_env,
        )
        self.runners.append(runner)
        return runner

    async def runner_ready(self, runner: ChildProcess) -> str:
        """The runner's gRPC address, once it serves and claims."""
        line = await runner.line(
            lambda text: text.startswith("runner ") and " listening on " in text
        )
        return line.rsplit(" ", 1)[1]

    async def new_session(self, session_id: str, tenant: str = "default") -> None:
        await self.ledger.create_session(session_id, tenant)

    async def send(self, session_id: str, text: str, request_id: str) -> int:
        """Commits an input and wakes the kernel, handing it the input as the
        edge does (a runner keeping the session then reads nothing)."""
        data = {"text": text, "requestId": request_id}
        appended = await self.ledger.append_one(session_id, "input", data)
        facts = b"" if appended.duplicate else pack_input(session_id, appended.seq, data)
        await self.kernel.enqueue(session_id, "default", input_seq=appended.seq, facts=facts)
        return appended.seq

    async def settled(self, session_id: str, deadline_s: float = 60.0) -> SessionView:
        """Waits until the session owes nothing (every input answered, no open call)."""

        async def probe() -> SessionView | None:
            view = await self.ledger.get_session(session_id)
            if view.owed_input_seqs or view.open_tool_calls:
                return None
            lease = await self.kernel.get_lease(session_id)
            return view if lease.lease is None and not lease.queued else None

        return await eventually(probe, f"{session_id} to settle", deadline_s)

    async def facts(self, session_id: str) -> list[CommittedFact]:
        return await self.ledger.read_all(session_id)

    def kill_all(self) -> None:
        for runner in self.runners:
            runner.kill()


async def start_cluster(settings: Settings, **kernel_config: int) -> Cluster:
    ledger_server = await LedgerServer(settings).start()
    config = KernelConfig(**kernel_config) if kernel_config else KernelConfig()
    kernel_server = await KernelServer(
        settings, ledger_target=ledger_server.target, config=config
    ).start()
    cluster = Cluster(
        settings=settings,
        ledger_server=ledger_server,
        kernel_server=kernel_server,
        ledger=LedgerClient(ledger_server.target, settings),
        kernel=KernelClient(kernel_server.target, settings),
    )
    await cluster.kernel.create_tenant("default", "Default tenant")
    return cluster


async def stop_cluster(cluster: Cluster) -> None:
    cluster.kill_all()
    await cluster.ledger.close()
    await cluster.kernel.close()
    await cluster.kernel_server.stop()
    await cluster.ledger_server.stop(grace=0.5)


@asynccontextmanager
async def running_ledger(settings: Settings, grace: float = 0.5) -> AsyncIterator[LedgerServer]:
    """A ledger server alone, stopped (with a short `grace`) when the block ends."""
    server = await LedgerServer(settings).start()
    try:
        yield server
    finally:
        await server.stop(grace=grace)


@asynccontextmanager
async def running_cluster(settings: Settings, **kernel_config: int) -> AsyncIterator[Cluster]:
    """`start_cluster`, stopped (`stop_cluster`) when the block ends, however."""
    cluster = await start_cluster(settings, **kernel_config)
    try:
        yield cluster
    finally:
        await stop_cluster(cluster)


async def wait_for_kind(cluster: Cluster, session: str, kind: str, count: int = 1) -> None:
    """Waits until `session` holds at least `count` facts of `kind`."""

    async def probe() -> bool:
        facts = await cluster.facts(session)
        return sum(f.kind == kind for f in facts) >= count

    await eventually(probe, f"{count} {kind} fact(s) in {session}")
