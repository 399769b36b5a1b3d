"""Nodes of a Keel deployment as real OS processes, for takeover measurements.

A node is what one machine runs: a kernel process and a runner process
attached to it (the runner talks to its own node's kernel only). Every node
shares one PostgreSQL schema and one ledger; the ledger runs in the calling
process, as the part that outlives any node. Losing a node is a SIGKILL of
its kernel and its runner together.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kernel import KernelClient
from services.common.config import Settings

ROOT = Path(__file__).resolve().parent.parent
KEEL = Path(sys.executable).with_name("keel")
START_DEADLINE_S = 60.0
_LISTENING = re.compile(r"listening on (\S+:\d+)")


class Child:
    """An OS process whose output lines are kept (a chatty child never
    blocks on a full pipe) and can be waited for."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self.process = process
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, name: str, args: list[str], env: Mapping[str, str]) -> Child:
        process = await asyncio.create_subprocess_exec(
            *args,
            cwd=ROOT,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        return cls(name, process)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            self.lines.append(line.decode(errors="replace").rstrip("\n"))
            self._changed.set()
        self._changed.set()

    async def line(self, predicate: Callable[[str], bool], deadline_s: float) -> str:
        """The first output line matching `predicate`; fails at the deadline
        or when the process exits first."""

        async def wait() -> str:
            seen = 0
            while True:
                for text in self.lines[seen:]:
                    if predicate(text):
                        return text
                seen = len(self.lines)
                if self._reader.done():
                    raise RuntimeError(f"{self.name} exited:\n" + "\n".join(self.lines[-40:]))
                self._changed.clear()
                await self._changed.wait()

        try:
            return await asyncio.wait_for(wait(), deadline_s)
        except TimeoutError:
            raise RuntimeError(
                f"{self.name} printed no expected line in {deadline_s}s:\n"
                + "\n".join(self.lines[-40:])
            ) from None

    async def listening(self) -> str:
        line = await self.line(lambda text: bool(_LISTENING.search(text)), START_DEADLINE_S)
        match = _LISTENING.search(line)
        assert match is not None
        return match.group(1)

    def kill(self) -> None:
        """A real SIGKILL (reaped by `reap`)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)

    async def reap(self) -> int:
        code = await self.process.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        return code


def node_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment a node's processes need to share `settings`' store."""
    env = dict(os.environ)
    env.update(
        KEEL_DATABASE_URL=settings.database_url,
        KEEL_PG_SCHEMA=settings.pg_schema,
        KEEL_DATA_DIR=str(settings.data_dir),
        KEEL_LEASE_MS=str(settings.lease_ms),
        KEEL_INTERNAL_TOKEN=settings.internal_token,
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


@dataclass
class Node:
    name: str
    kernel: Child
    kernel_target: str
    ledger_target: str
    env: dict[str, str]
    # Runtime id -> its runner process.
    runners: dict[str, Child] = field(default_factory=dict)
    _started: int = 0

    async def add_runner(self) -> str:
        """One more runner attached to this node's kernel; its runtime id,
        once it serves."""
        self._started += 1
        runtime_id = f"{self.name}-runner-{self._started}"
        runner = await Child.start(
            runtime_id,
            [
                sys.executable,
                "-m",
                "services.runner",
                "--ledger",
                self.ledger_target,
                "--kernel",
                self.kernel_target,
            ],
            {**self.env, "KEEL_RUNTIME_ID": runtime_id},
        )
        self.runners[runtime_id] = runner
        await runner.listening()
        return runtime_id

    def kill(self) -> None:
        """The node is lost: its kernel and its runners SIGKILLed together."""
        for runner in self.runners.values():
            runner.kill()
        self.kernel.kill()

    async def reap(self) -> list[int]:
        children = [*self.runners.values(), self.kernel]
        return [await child.reap() for child in children]

    async def stop(self) -> None:
        children = [*self.runners.values(), self.kernel]
        for child in children:
            if child.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.terminate()
        for child in children:
            try:
                await asyncio.wait_for(child.reap(), 20)
            except TimeoutError:
                child.kill()
                await child.reap()


async def start_node(
    name: str,
    ledger_target: str,
    settings: Settings,
    runners: int = 1,
    env: Mapping[str, str] | None = None,
) -> Node:
    """A kernel process, then `runners` runner processes attached to it."""
    base = node_env(settings, **(env or {}))
    # Each node its own data dir: another machine's local records are not
    # its to read.
    base["KEEL_DATA_DIR"] = str(Path(settings.data_dir) / name)
    kernel = await Child.start(
        f"{name}-kernel",
        [str(KEEL), "kernel", "--address", "127.0.0.1:0", "--ledger", ledger_target],
        base,
    )
    node = Node(name, kernel, "", ledger_target, base)
    try:
        node.kernel_target = await kernel.listening()
        await asyncio.gather(*(node.add_runner() for _ in range(runners)))
    except BaseException:
        node.kill()
        await node.reap()
        raise
    return node


async def holder(kernel: KernelClient, session_id: str) -> tuple[str, int] | None:
    """(runtime id, epoch) of the live lease on `session_id`, or None."""
    info = await kernel.get_lease(session_id)
    if info.lease is None:
        return None
    return info.lease.runtime_id, info.lease.epoch


async def start_nodes(
    names: Sequence[str],
    ledger_target: str,
    settings: Settings,
    env: Mapping[str, str] | None = None,
) -> list[Node]:
    """Nodes started at once; if one fails, the others are killed too."""
    started = await asyncio.gather(
        *(start_node(name, ledger_target, settings, env=env) for name in names),
        return_exceptions=True,
    )
    nodes = [node for node in started if isinstance(node, Node)]
    failure = next((error for error in started if isinstance(error, BaseException)), None)
    if failure is not None:
        for node in nodes:
            node.kill()
            await node.reap()
        raise failure
    return nodes
