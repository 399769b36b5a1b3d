"""Benchmark of takeover: a runner SIGKILLed, and a whole node lost.

Every trial starts one session on a slow scripted answer (`/slow`), waits
until its owner has committed `epoch_started`, SIGKILLs, and measures from
the kill to the successor's first commit (its `epoch_started`, epoch + 1).

- Runner SIGKILL: one node (a kernel process and two runner processes, as
  `keel up --processes` runs them) with `KEEL_LEASE_MS=2000`; only the
  owning runner dies, so its kernel sees the Attach stream end (the fast
  path). A trial that waited for the TTL counts in `over_ttl`.
- Node loss: two nodes (each a kernel process and a runner process) on one
  PostgreSQL schema, with the default 30 s TTL; the owner's kernel and
  runner are SIGKILLed together, so only the heartbeat (kernel.liveness)
  seen by the other node's kernel can make it quick. The lost node is
  started again (a new one) for the next trial.

Prints JSON with p50/p99/max and the count over the TTL for each.

Run: `keel bench takeover` (KEEL_DATABASE_URL selects the PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psycopg
from psycopg import sql

from bench.nodes import Node, holder, start_node, start_nodes
from kernel import KernelClient
from services.common.config import DEFAULT_LEASE_MS, Settings
from services.ledger import LedgerClient, LedgerServer

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
RUNNER_KILL_LEASE_MS = 2_000
TENANT = "default"
# The owner's answer outlasts the measurement; the successor's is quick
# enough to settle the session soon after.
SLOW_ANSWER = "/slow 3 a slow answer the successor finishes"
TRIAL_DEADLINE_S = 90.0
T = TypeVar("T")


@dataclass(frozen=True)
class Takeover:
    session_id: str
    victim: str
    successor: str
    # From the SIGKILL to the successor's first commit.
    ms: float


def _percentile(samples: Sequence[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def summary(samples: Sequence[Takeover], lease_ms: int) -> dict[str, float]:
    values = [t.ms for t in samples]
    return {
        "count": float(len(values)),
        "p50_ms": round(_percentile(values, 0.50), 1),
        "p99_ms": round(_percentile(values, 0.99), 1),
        "max_ms": round(max(values), 1),
        "over_ttl": float(sum(1 for v in values if v >= lease_ms)),
        "lease_ttl_ms": float(lease_ms),
    }


async def _poll(probe: Callable[[], Awaitable[T | None]], what: str) -> T:
    deadline = time.monotonic() + TRIAL_DEADLINE_S
    while True:
        value = await probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def start_session(ledger: LedgerClient, kernel: KernelClient, session_id: str) -> None:
    await ledger.create_session(session_id, TENANT)
    appended = await ledger.append_one(
        session_id, "input", {"text": SLOW_ANSWER, "requestId": f"{session_id}-1"}
    )
    await kernel.enqueue(session_id, TENANT, input_seq=appended.seq)


async def owner_started(
    ledger: LedgerClient, kernel: KernelClient, session_id: str
) -> tuple[str, int]:
    """(runtime id, epoch) of the session's owner, once it committed its
    `epoch_started` (it is running the answer)."""

    async def probe() -> tuple[str, int] | None:
        held = await holder(kernel, session_id)
        if held is None:
            return None
        facts = await ledger.read_all(session_id)
        started = any(f.kind == "epoch_started" and f.epoch == held[1] for f in facts)
        return held if started else None

    return await _poll(probe, f"an owner of {session_id} to start")


async def successor_commit(ledger: LedgerClient, session_id: str, epoch: int) -> str:
    """The runtime id of the first `epoch_started` after `epoch`, once there is one."""

    async def probe() -> str | None:
        facts = await ledger.read_all(session_id)
        return next(
            (
                str(f.data.get("runtimeId", ""))
                for f in facts
                if f.kind == "epoch_started" and f.epoch > epoch
            ),
            None,
        )

    return await _poll(probe, f"a successor's commit on {session_id}")


async def kill_and_time(
    ledger: LedgerClient,
    kernel: KernelClient,
    session_id: str,
    kill: Callable[[str], None],
) -> Takeover:
    """Waits for the owner to run `session_id`, calls `kill(owner)`, and
    times the successor's first commit (its `epoch_started`)."""
    victim, epoch = await owner_started(ledger, kernel, session_id)
    started = time.perf_counter()
    kill(victim)
    successor = await successor_commit(ledger, session_id, epoch)
    elapsed_ms = (time.perf_counter() - started) * 1000
    return Takeover(session_id, victim, successor, elapsed_ms)


@contextlib.asynccontextmanager
async def deployment(
    database_url: str, lease_ms: int
) -> AsyncIterator[tuple[Settings, LedgerServer, LedgerClient]]:
    """A ledger in this process on a fresh schema (dropped afterwards)."""
    schema = f"keel_bench_{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="keel-bench-takeover-") as data_dir:
        settings = Settings(
            database_url=database_url,
            pg_schema=schema,
            data_dir=Path(data_dir),
            lease_ms=lease_ms,
            internal_token=secrets.token_urlsafe(32),
        )
        server = await LedgerServer(settings).start()
        client = LedgerClient(server.target, settings)
        try:
            yield settings, server, client
        finally:
            await client.close()
            await server.stop(grace=0.5)
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )


async def _runner_kills(database_url: str, trials: int, seed: int) -> list[Takeover]:
    jitter = random.Random(seed)
    samples: list[Takeover] = []
    async with deployment(database_url, RUNNER_KILL_LEASE_MS) as (settings, ledger_server, ledger):
        node = await start_node("node", ledger_server.target, settings, runners=2)
        try:
            async with KernelClient(node.kernel_target, settings) as kernel:
                await kernel.create_tenant(TENANT, "Default tenant")
                replaced: list[str] = []

                def kill_runner(runtime_id: str) -> None:
                    node.runners[runtime_id].kill()
                    replaced.append(runtime_id)

                for n in range(trials):
                    session_id = f"kill-{n:03d}"
                    await start_session(ledger, kernel, session_id)
                    # Somewhere in the first part of the streamed answer.
                    await asyncio.sleep(jitter.uniform(0, 0.3))
                    samples.append(await kill_and_time(ledger, kernel, session_id, kill_runner))
                    while replaced:
                        await node.runners.pop(replaced.pop()).reap()
                    # Two runners again, for the next trial.
                    await node.add_runner()
        finally:
            await node.stop()
    return samples


async def lose_owner_node(
    ledger: LedgerClient, nodes: Sequence[Node], settings: Settings, session_id: str
) -> tuple[Takeover, Node, Node]:
    """Starts `session_id`, loses the node whose runner took it (its kernel
    and runners SIGKILLed), and times the takeover; (takeover, lost node,
    surviving node). Probes go through each node's own kernel, as a client
    of that node would, so the lost node's probes stop with it."""
    async with KernelClient(nodes[0].kernel_target, settings) as kernel:
        await start_session(ledger, kernel, session_id)
        owner, _ = await owner_started(ledger, kernel, session_id)
    lost = next(node for node in nodes if owner in node.runners)
    survivor = next(node for node in nodes if node is not lost)
    async with KernelClient(survivor.kernel_target, settings) as kernel:
        takeover = await kill_and_time(ledger, kernel, session_id, lambda _: lost.kill())
    return takeover, lost, survivor


async def _node_losses(database_url: str, trials: int) -> list[Takeover]:
    samples: list[Takeover] = []
    async with deployment(database_url, DEFAULT_LEASE_MS) as (settings, ledger_server, ledger):
        started = 2

        async def new_node() -> Node:
            nonlocal started
            started += 1
            return await start_node(f"node-{started}", ledger_server.target, settings)

        nodes = await start_nodes(["node-1", "node-2"], ledger_server.target, settings)
        try:
            async with KernelClient(nodes[0].kernel_target, settings) as admin:
                await admin.create_tenant(TENANT, "Default tenant")
            for n in range(trials):
                takeover, lost, survivor = await lose_owner_node(
                    ledger, nodes, settings, f"loss-{n:03d}"
                )
                samples.append(takeover)
                await lost.reap()
                nodes = [survivor, await new_node()]
        finally:
            for node in nodes:
                await node.stop()
    return samples


async def _measure(database_url: str, runner_kills: int, node_losses: int) -> dict[str, object]:
    kills = await _runner_kills(database_url, runner_kills, seed=14)
    losses = await _node_losses(database_url, node_losses)
    return {
        "benchmark": "takeover",
        "runner_sigkill": summary(kills, RUNNER_KILL_LEASE_MS),
        "node_loss": summary(losses, DEFAULT_LEASE_MS),
    }


def measure(
    database_url: str | None = None, runner_kills: int = 50, node_losses: int = 5
) -> dict[str, object]:
    url = database_url or os.environ.get("KEEL_DATABASE_URL") or DEFAULT_URL
    return asyncio.run(_measure(url, runner_kills, node_losses))


if __name__ == "__main__":
    print(json.dumps(measure(), indent=2))
