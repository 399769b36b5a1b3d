"""Keel's ledger, kernel and runner each in an OS process of its own, as
`keel up --processes` runs them, on a throwaway PostgreSQL schema: the
other layout `keel bench turns --layout split` measures against one process.

The benchmark's client stays in the calling process. CPU is read for every
process (Linux /proc), so a turn's CPU is comparable with the one-process
layout's; RPC and commit counts are per process and are not gathered here.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from bench.cluster import DEFAULT_URL
from bench.ledger import process_cpu_s
from bench.nodes import KEEL, Child
from kernel import KernelClient
from services.cli.up import bootstrap_tenant
from services.common.config import Settings

# How long the last attempts may take to settle after the last answer.
SETTLE_S = 10.0


@dataclass
class SplitCluster:
    settings: Settings
    ledger_target: str
    kernel_target: str
    children: list[Child]

    def cpu_by_process(self) -> dict[str, float]:
        """CPU seconds each service process has used so far."""
        return {child.name: process_cpu_s(child.process.pid) for child in self.children}

    async def settle(self, session_ids: list[str]) -> None:
        """Until no session is held: the last turns' Finishes are in."""
        deadline = time.monotonic() + SETTLE_S
        async with KernelClient(self.kernel_target, self.settings) as kernel:
            while time.monotonic() < deadline:
                infos = await asyncio.gather(*(kernel.get_lease(s) for s in session_ids))
                if all(info.lease is None for info in infos):
                    return
                await asyncio.sleep(0.005)  # polling with a deadline

    async def stop(self) -> None:
        for child in reversed(self.children):
            if child.process.returncode is None:
                child.process.terminate()
            try:
                await asyncio.wait_for(child.reap(), 20)
            except TimeoutError:
                child.kill()
                await child.reap()
        with psycopg.connect(self.settings.database_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(self.settings.pg_schema)
                )
            )


async def start_split(database_url: str | None, concurrency: int) -> SplitCluster:
    url = database_url or os.environ.get("KEEL_DATABASE_URL") or DEFAULT_URL
    settings = Settings(
        database_url=url,
        pg_schema=f"keel_bench_{uuid.uuid4().hex[:8]}",
        data_dir=Path(tempfile.mkdtemp(prefix="keel-bench-")),
        internal_token=secrets.token_urlsafe(32),
        log_level="WARNING",
    )
    env = dict(os.environ)
    env.update(
        KEEL_DATABASE_URL=url,
        KEEL_PG_SCHEMA=settings.pg_schema,
        KEEL_DATA_DIR=str(settings.data_dir),
        KEEL_INTERNAL_TOKEN=settings.internal_token,
        KEEL_LOG_LEVEL="WARNING",
        KEEL_RUNNER_CONCURRENCY=str(concurrency),
        KEEL_CLAIM_WAIT_MS="500",
        PYTHONUNBUFFERED="1",
    )
    children: list[Child] = []
    cluster = SplitCluster(settings, "", "", children)
    try:
        ledger = await Child.start(
            "ledger", [sys.executable, "-m", "services.ledger", "--address", "127.0.0.1:0"], env
        )
        children.append(ledger)
        cluster.ledger_target = await ledger.listening()
        kernel = await Child.start(
            "kernel",
            [str(KEEL), "kernel", "--address", "127.0.0.1:0", "--ledger", cluster.ledger_target],
            env,
        )
        children.append(kernel)
        cluster.kernel_target = await kernel.listening()
        await bootstrap_tenant(cluster.kernel_target, settings, "bench-key-0123456789abcdef")
        async with KernelClient(cluster.kernel_target, settings) as client:
            document = (await client.get_loadout("default")).document
            await client.put_loadout("default", {**document, "maxConcurrentRuns": concurrency})
        runner = await Child.start(
            "runner",
            [
                *(sys.executable, "-m", "services.runner"),
                *("--ledger", cluster.ledger_target, "--kernel", cluster.kernel_target),
            ],
            env,
        )
        children.append(runner)
        await runner.listening()
    except BaseException:
        await cluster.stop()
        raise
    return cluster
