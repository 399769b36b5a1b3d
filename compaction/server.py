"""Running the compaction service: `keel compaction`, `python -m compaction`,
or mounted on another process's gRPC server (a runner embeds it by default).

Mounted or standalone, callers reach it only through its gRPC contract, so
the embedded copy exercises exactly the code a separate process runs.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from compaction.service import DEFAULT_CONTEXT_WINDOW, CompactionServicer
from keel.compaction.v1 import compaction_pb2 as pb
from keel.compaction.v1 import compaction_pb2_grpc as pb_grpc
from kernel import KernelClient
from services.common.config import Settings
from services.common.serving import (
    GrpcService,
    RunningServer,
    ServedOnOneAddress,
    serve_services,
    serve_until_cancelled,
)
from services.ledger import LedgerClient

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CompactionService"].full_name


@dataclass(frozen=True)
class CompactionMount(GrpcService):
    """The service ready to mount; `close` releases its channels and model
    providers once the server hosting it has stopped."""

    close: Callable[[], Awaitable[None]] | None = None


def compaction_service(
    settings: Settings,
    ledger_target: str,
    kernel_target: str,
    *,
    default_context_window: int = DEFAULT_CONTEXT_WINDOW,
) -> CompactionMount:
    """The compaction service, talking to the ledger and kernel at the given targets."""
    ledger = LedgerClient(ledger_target, settings)
    kernel = KernelClient(kernel_target, settings)
    # The blob store comes from the same Settings as the edge's and the
    # runner's: the same directory or database.
    servicer = CompactionServicer(
        ledger, kernel, default_context_window=default_context_window, blob_settings=settings
    )

    async def close() -> None:
        await servicer.close()
        await ledger.close()
        await kernel.close()

    return CompactionMount(
        name=SERVICE_NAME,
        add_to_server=lambda server: pb_grpc.add_CompactionServiceServicer_to_server(
            servicer, server
        ),
        close=close,
    )


class CompactionServer(ServedOnOneAddress):
    """The compaction service alone on one address."""

    def __init__(
        self,
        settings: Settings,
        ledger_target: str,
        kernel_target: str,
        address: str = "127.0.0.1:0",
        *,
        default_context_window: int = DEFAULT_CONTEXT_WINDOW,
    ) -> None:
        self.settings = settings
        self.ledger_target = ledger_target
        self.kernel_target = kernel_target
        self.address = address
        self.default_context_window = default_context_window
        self.mount: CompactionMount | None = None
        self.running: RunningServer | None = None

    async def start(self) -> CompactionServer:
        self.mount = compaction_service(
            self.settings,
            self.ledger_target,
            self.kernel_target,
            default_context_window=self.default_context_window,
        )
        try:
            self.running = await serve_services([self.mount], self.address, self.settings)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self, grace: float = 2.0) -> None:
        if self.running is not None:
            await self.running.stop(grace)
            self.running = None
        if self.mount is not None and self.mount.close is not None:
            await self.mount.close()
            self.mount = None


async def run_compaction(
    settings: Settings,
    address: str,
    ledger_target: str,
    kernel_target: str,
    *,
    default_context_window: int = DEFAULT_CONTEXT_WINDOW,
) -> None:
    """Serves until cancelled (SIGINT/SIGTERM)."""
    server = await CompactionServer(
        settings,
        ledger_target,
        kernel_target,
        address,
        default_context_window=default_context_window,
    ).start()
    await serve_until_cancelled(server, "compaction", log)
