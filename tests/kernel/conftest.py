"""Kernel fixtures: stores on a controllable clock, and real gRPC servers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from kernel import KernelClient, KernelServer
from services.common.config import Settings
from tests.support.kernel_stores import FAST, LONG_TTL_MS, NO_RECHECK, Stores, open_stores


@pytest.fixture
def stores(settings: Settings) -> Iterator[Stores]:
    opened = open_stores(settings)
    yield opened
    opened.database.close()


@pytest.fixture
def long_ttl(settings: Settings) -> Settings:
    return settings.with_overrides(lease_ms=LONG_TTL_MS)


@pytest.fixture
async def kernel(long_ttl: Settings) -> AsyncIterator[KernelServer]:
    server = await KernelServer(long_ttl, config=FAST).start()
    yield server
    await server.stop()


@pytest.fixture
async def evented(long_ttl: Settings) -> AsyncIterator[KernelServer]:
    """A kernel whose claims are woken by events alone (no periodic re-check)."""
    server = await KernelServer(long_ttl, config=NO_RECHECK).start()
    yield server
    await server.stop()


@pytest.fixture
async def client(kernel: KernelServer) -> AsyncIterator[KernelClient]:
    async with KernelClient(kernel.target, kernel.settings) as opened:
        yield opened
