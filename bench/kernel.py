"""Benchmark of the kernel: claim throughput and SIGKILL takeover latency.

- `claims_per_s`: 500 runnable sessions taken by 4 concurrent claimers
  (each its own runtime and gRPC channel) from a KernelServer.
- `takeover_p50_ms` / `takeover_p99_ms`: a real runtime process holds a
  lease (registered, attached, renewing) and is SIGKILLed; measured from the
  kill to the successor's successful claim of that session, over 20+
  kills, with the default 30 s TTL — so only the fast takeover path (the
  owner's Attach stream breaking) can make it quick. Target: p99 ≤ 1000 ms.

Runs on PostgreSQL when given a URL (in a fresh schema, dropped afterwards),
else on SQLite in a temporary directory.

Run: `python -m bench.kernel` (KEEL_DATABASE_URL selects PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg import sql

from kernel.client import KernelClient
from kernel.config import KernelConfig
from kernel.server import KernelServer
from services.common import event_loop
from services.common.config import DEFAULT_LEASE_MS, Settings

ROOT = Path(__file__).resolve().parent.parent
SESSIONS = 500
CLAIMERS = 4
KILLS = 20
# Holders started at once (process start-up dominates the benchmark's time).
HOLDER_BATCH = 5
TENANT = "bench"


@contextlib.contextmanager
def _bench_settings(database_url: str | None) -> Iterator[Settings]:
    # Measured as deployed: every call carries and is checked for a token.
    token = secrets.token_urlsafe(32)
    with tempfile.TemporaryDirectory(prefix="keel-bench-kernel-") as data_dir:
        if not database_url:
            yield Settings(data_dir=Path(data_dir), lease_ms=DEFAULT_LEASE_MS, internal_token=token)
            return
        schema = f"keel_bench_{uuid.uuid4().hex[:12]}"
        try:
            yield Settings(
                database_url=database_url,
                pg_schema=schema,
                data_dir=Path(data_dir),
                lease_ms=DEFAULT_LEASE_MS,
                internal_token=token,
            )
        finally:
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )


def _percentile(samples: list[float], fraction: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


async def _claims_per_s(target: str, settings: Settings) -> float:
    async with KernelClient(target, settings) as admin:
        await admin.create_tenant(TENANT)
        await admin.put_loadout(TENANT, {"maxConcurrentRuns": SESSIONS * 2})
        for start in range(0, SESSIONS, 50):
            await asyncio.gather(
                *(
                    admin.enqueue(f"claim-{n:04d}", TENANT, input_seq=1)
                    for n in range(start, min(start + 50, SESSIONS))
                )
            )
    clients = [KernelClient(target, settings) for _ in range(CLAIMERS)]
    try:
        for n, client in enumerate(clients):
            await client.register_runtime(f"bench-claimer-{n}")

        async def drain(client: KernelClient, runtime_id: str) -> int:
            taken = 0
            while await client.claim(runtime_id) is not None:
                taken += 1
            return taken

        started = time.perf_counter()
        counts = await asyncio.gather(
            *(drain(client, f"bench-claimer-{n}") for n, client in enumerate(clients))
        )
        elapsed = time.perf_counter() - started
    finally:
        for client in clients:
            await client.close()
    if sum(counts) != SESSIONS:
        raise RuntimeError(f"claimed {sum(counts)} of {SESSIONS} sessions")
    return SESSIONS / elapsed


async def _start_holder(
    target: str, runtime_id: str, settings: Settings
) -> asyncio.subprocess.Process:
    """A runtime process holding one lease; returns once it holds it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.kernel_holder",
        target,
        runtime_id,
        "--sessions",
        "1",
        cwd=ROOT,
        env={**os.environ, "KEEL_INTERNAL_TOKEN": settings.internal_token},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    output: list[str] = []
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        if not line:
            await process.wait()
            raise RuntimeError(f"holder {runtime_id} exited:\n{''.join(output)}")
        output.append(line)
        if line.startswith("holder ready"):
            return process


async def _kill_and_take_over(
    client: KernelClient, holder: asyncio.subprocess.Process, successor: str
) -> float:
    """SIGKILLs the holder; ms until the successor's claim came back with
    that lease."""
    claim = asyncio.create_task(client.claim(successor, wait_ms=2 * DEFAULT_LEASE_MS))
    started = time.perf_counter()
    holder.kill()
    lease = await claim
    elapsed_ms = (time.perf_counter() - started) * 1000
    await holder.wait()
    if lease is None or not lease.reclaimed:
        raise RuntimeError(f"the successor did not reclaim the lease: {lease}")
    return elapsed_ms


async def _takeovers(server: KernelServer) -> list[float]:
    samples: list[float] = []
    holders: list[asyncio.subprocess.Process] = []
    async with KernelClient(server.target, server.settings) as client:
        await client.register_runtime("bench-successor")
        try:
            for batch in range(math.ceil(KILLS / HOLDER_BATCH)):
                names = [f"take-{batch}-{n}" for n in range(HOLDER_BATCH)]
                for name in names:
                    await client.enqueue(name, TENANT, input_seq=1)
                holders = list(
                    await asyncio.gather(
                        *(
                            _start_holder(server.target, f"holder-{name}", server.settings)
                            for name in names
                        )
                    )
                )
                for holder in holders:
                    samples.append(await _kill_and_take_over(client, holder, "bench-successor"))
        finally:
            for holder in holders:
                if holder.returncode is None:
                    holder.kill()
                    await holder.wait()
    if server.metrics.totals().get("expirations_ttl", 0):
        raise RuntimeError("a lease expired by TTL: the takeover did not take the fast path")
    return samples


async def _measure(database_url: str | None) -> dict[str, float]:
    with _bench_settings(database_url) as settings:
        server = await KernelServer(settings, config=KernelConfig()).start()
        try:
            claims_per_s = await _claims_per_s(server.target, settings)
            takeovers = await _takeovers(server)
        finally:
            await server.stop()
    return {
        "claims_per_s": round(claims_per_s, 1),
        "takeover_p50_ms": round(_percentile(takeovers, 0.50), 2),
        "takeover_p99_ms": round(_percentile(takeovers, 0.99), 2),
        "takeover_max_ms": round(max(takeovers), 2),
        "takeover_kills": float(len(takeovers)),
        "lease_ttl_ms": float(DEFAULT_LEASE_MS),
    }


def measure(database_url: str | None = None) -> dict[str, float]:
    """Runs the kernel benchmark; cleans up its schema or directory."""
    return event_loop.run(_measure(database_url))


if __name__ == "__main__":
    print(json.dumps(measure(os.environ.get("KEEL_DATABASE_URL") or None), indent=2))
