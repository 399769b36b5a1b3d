from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.config import Settings
from tests.support.cluster import Cluster, running_cluster


@pytest.fixture
async def cluster(pg_settings: Settings) -> AsyncIterator[Cluster]:
    async with running_cluster(pg_settings, backoff_base_ms=100, max_attempts=3) as running:
        yield running
