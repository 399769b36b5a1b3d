"""Running the ledger service: `keel ledger`, and embedded in `keel up`."""

from __future__ import annotations

import asyncio
import logging

from services.common.config import Settings
from services.common.serving import (
    RunningServer,
    ServedOnOneAddress,
    serve_services,
    serve_until_cancelled,
)
from services.ledger.servicer import ledger_service
from services.ledger.store import LedgerStore
from services.ledger.waker import SessionWaker

log = logging.getLogger(__name__)


class LedgerServer(ServedOnOneAddress):
    """The ledger store served over gRPC on one address."""

    def __init__(self, settings: Settings, address: str = "127.0.0.1:0") -> None:
        self.settings = settings
        self.address = address
        self.waker = SessionWaker()
        self.store: LedgerStore | None = None
        self.running: RunningServer | None = None

    async def start(self) -> LedgerServer:
        self.waker.bind(asyncio.get_running_loop())
        self.store = await asyncio.to_thread(
            LedgerStore, self.settings, self.waker.notify, self.waker.committed
        )
        service = ledger_service(self.store, self.waker, self.settings)
        self.running = await serve_services([service], self.address, self.settings)
        return self

    async def stop(self, grace: float = 2.0) -> None:
        if self.running is not None:
            await self.running.stop(grace)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)


async def run_ledger(settings: Settings, address: str) -> None:
    """Serves until cancelled (SIGINT/SIGTERM), then drains subscribers."""
    server = await LedgerServer(settings, address).start()
    await serve_until_cancelled(server, "ledger", log)
