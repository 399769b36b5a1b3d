"""A real edge over real HTTP, on PostgreSQL, for the edge's end-to-end tests.

`stack` is an in-process ledger and kernel (tests/support/cluster.py), a
compaction server (the edge's /context), an EdgeServer on 127.0.0.1:0 (its
gRPC API on another free port) and an httpx client carrying the key of
tenant "default" that `keel up` prints: its admin and an operator. A runner
is added only where a test asks for one: in process (`runner` fixture) or as
an OS process (`stack.cluster.start_runner`) when the test SIGKILLs it.
Nothing of ours is mocked; waits poll with a deadline or wait for SSE
frames, never sleep.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser

from compaction.server import CompactionServer
from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from services.common.config import Settings
from services.runner.server import RunnerServer
from tests.support.cluster import start_cluster, stop_cluster
from tests.support.edge_stack import ADMIN_KEY, DEADLINE_S, Stack
from tests.support.front_doors import FrontDoor, GrpcDoor, HttpDoor
from tests.support.web_page import keel_up, launched_browser, require_chromium


@pytest.fixture
async def stack(pg_settings: Settings) -> AsyncIterator[Stack]:
    cluster = await start_cluster(pg_settings, backoff_base_ms=100, max_attempts=3)
    compaction: CompactionServer | None = None
    edge: EdgeServer | None = None
    http: httpx.AsyncClient | None = None
    running: Stack | None = None
    try:
        await cluster.kernel.create_api_key("default", ADMIN_KEY, admin=True, operator=True)
        compaction = await CompactionServer(
            pg_settings, cluster.ledger_server.target, cluster.kernel_server.target
        ).start()
        edge = await EdgeServer(
            pg_settings,
            EdgeConfig(
                cluster.ledger_server.target,
                cluster.kernel_server.target,
                compaction.target,
                drain_retry_after_ms=250,
                grpc_port=0,
            ),
        ).start()
        http = httpx.AsyncClient(
            base_url=edge.url,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=httpx.Timeout(DEADLINE_S),
        )
        running = Stack(cluster, edge, http, compaction)
        yield running
    finally:
        if http is not None:
            await http.aclose()
        if edge is not None:
            await edge.stop()
        if running is not None:
            for runner in running.runners:
                await runner.stop(grace=0.2)
        if compaction is not None:
            await compaction.stop(grace=0.2)
        await stop_cluster(cluster)


@pytest.fixture
async def runner(stack: Stack) -> RunnerServer:
    """An in-process runner working for `stack` (stopped with it)."""
    return await stack.start_runner()


@pytest.fixture
def base_url(tmp_path: Path) -> Iterator[str]:
    """The URL of a whole `keel up`, for the web page's tests in a real
    browser (skipped without Chromium, failed under CI)."""
    require_chromium()
    with keel_up(tmp_path / "data") as url:
        yield url


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with launched_browser() as launched:
        yield launched


@pytest.fixture(params=["http", "grpc"])
async def door(request: pytest.FixtureRequest, stack: Stack) -> AsyncIterator[FrontDoor]:
    """The stack's front door, once over HTTP and once over gRPC, with the
    admin key of tenant "default"."""
    opened: FrontDoor = (
        HttpDoor(stack.url, ADMIN_KEY)
        if request.param == "http"
        else GrpcDoor(stack.grpc_address, ADMIN_KEY)
    )
    try:
        yield opened
    finally:
        await opened.close()
