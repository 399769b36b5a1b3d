"""An embedded Keel (ledger, kernel, runner, edge) on a throwaway PostgreSQL schema."""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from kernel import KernelServer
from services.cli.up import bootstrap_tenant
from services.common import telemetry
from services.common.config import Settings
from services.ledger import LedgerServer
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


@dataclass
class BenchCluster:
    settings: Settings
    ledger: LedgerServer
    kernel: KernelServer
    runner: RunnerServer
    edge: EdgeServer | None
    key: str

    async def stop(self) -> None:
        if self.edge is not None:
            await self.edge.stop()
        await self.runner.stop()
        await self.kernel.stop()
        await self.ledger.stop()
        with psycopg.connect(self.settings.database_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(self.settings.pg_schema)
                )
            )


async def start(
    database_url: str | None, *, with_edge: bool, concurrency: int = 64
) -> BenchCluster:
    url = database_url or os.environ.get("KEEL_DATABASE_URL") or DEFAULT_URL
    # KEEL_OTEL_EXPORTER (and the OTLP endpoints) as a service would read
    # them, so a benchmark measures the exporter on as well as off. Off, the
    # process is left as it is (a test calling a benchmark keeps its logging).
    from_env = Settings.from_env()
    settings = Settings(
        database_url=url,
        pg_schema=f"keel_bench_{uuid.uuid4().hex[:8]}",
        data_dir=Path(tempfile.mkdtemp(prefix="keel-bench-")),
        otel_exporter=from_env.otel_exporter,
        otlp_traces_endpoint=from_env.otlp_traces_endpoint,
        otlp_metrics_endpoint=from_env.otlp_metrics_endpoint,
        log_level="WARNING",
    )
    if from_env.otel_exporter.lower() != "none":
        telemetry.configure("bench", settings)
    ledger = await LedgerServer(settings).start()
    kernel = await KernelServer(settings, ledger_target=ledger.target).start()
    key = await bootstrap_tenant(kernel.target, settings, "bench-key-0123456789abcdef")
    from kernel import KernelClient

    async with KernelClient(kernel.target, settings) as client:
        document = (await client.get_loadout("default")).document
        await client.put_loadout("default", {**document, "maxConcurrentRuns": concurrency})
    # KEEL_STICKY_MS as keel up reads it (0 measures every turn claimed).
    sticky_ms = RunnerConfig.from_env(ledger.target, kernel.target).sticky_ms
    config = RunnerConfig(
        ledger.target,
        kernel.target,
        concurrency=concurrency,
        claim_wait_ms=500,
        sticky_ms=sticky_ms,
    )
    runner = await RunnerServer(settings, config).start()
    edge = None
    if with_edge:
        edge = await EdgeServer(settings, EdgeConfig(ledger.target, kernel.target)).start()
    return BenchCluster(settings, ledger, kernel, runner, edge, key)
