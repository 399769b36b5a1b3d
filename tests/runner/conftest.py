from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.config import Settings
from tests.support.cluster import Cluster, start_cluster, stop_cluster


@pytest.fixture
async def cluster(pg_settings: Settings) -> AsyncIterator[Cluster]:
    running = await start_cluster(pg_settings, backoff_base_ms=100, max_attempts=3)
    try:
        yield running
    finally:
        await stop_cluster(running)
