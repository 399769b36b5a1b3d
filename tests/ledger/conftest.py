from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer


@pytest.fixture
async def ledger(settings: Settings) -> AsyncIterator[LedgerServer]:
    server = await LedgerServer(settings).start()
    yield server
    await server.stop(grace=0.5)


@pytest.fixture
async def client(ledger: LedgerServer) -> AsyncIterator[LedgerClient]:
    async with LedgerClient(ledger.target, ledger.settings) as ledger_client:
        yield ledger_client
