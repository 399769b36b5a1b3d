from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer
from tests.support.cluster import running_ledger


@pytest.fixture
async def ledger(settings: Settings) -> AsyncIterator[LedgerServer]:
    async with running_ledger(settings) as server:
        yield server


@pytest.fixture
async def client(ledger: LedgerServer) -> AsyncIterator[LedgerClient]:
    async with LedgerClient(ledger.target, ledger.settings) as ledger_client:
        yield ledger_client
