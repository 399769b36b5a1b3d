"""/readyz says whether this edge can take requests, and what is missing.

An edge whose ledger or kernel does not answer is not ready: a balancer
must stop sending it clients, and the 503 names what is unreachable and
carries Retry-After. (The ledger and kernel here are real servers, or a port
where nothing listens.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from services.common.config import Settings
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.ports import free_port


@pytest.fixture
async def cluster(pg_settings: Settings) -> AsyncIterator[Cluster]:
    running = await start_cluster(pg_settings)
    try:
        yield running
    finally:
        await stop_cluster(running)


async def readiness(settings: Settings, ledger: str, kernel: str) -> httpx.Response:
    edge = await EdgeServer(settings, EdgeConfig(ledger, kernel)).start()
    try:
        async with httpx.AsyncClient(base_url=edge.url) as http:
            return await http.get("/readyz")
    finally:
        await edge.stop()


async def test_an_edge_is_ready_when_ledger_and_kernel_answer(cluster: Cluster) -> None:
    ready = await readiness(
        cluster.settings, cluster.ledger_server.target, cluster.kernel_server.target
    )
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"ready": True}


@pytest.mark.parametrize("missing", ["ledger", "kernel"])
async def test_an_edge_without_its_ledger_or_kernel_is_not_ready(
    cluster: Cluster, missing: str
) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    ledger = nowhere if missing == "ledger" else cluster.ledger_server.target
    kernel = nowhere if missing == "kernel" else cluster.kernel_server.target
    refused = await readiness(cluster.settings, ledger, kernel)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "unavailable"
    assert error["message"] == f"not reachable: {missing}"
    assert int(refused.headers["Retry-After"]) >= 1
