"""The one place internal gRPC errors become exceptions
(services.common.errors.error_from_rpc): a service's "cannot answer now"
stays retryable across the hop, whatever reason names it."""

from __future__ import annotations

import grpc

from kernel.errors import KernelError
from services.common.errors import (
    DatabaseUnavailable,
    KeelError,
    ServiceUnavailable,
    error_from_rpc,
    reasons_of,
)
from services.ledger.errors import LedgerError, StaleEpoch


def _failed(error: KeelError) -> grpc.aio.AioRpcError:
    status = error.to_status()
    return grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        status.details,
    )


def test_another_services_database_outage_stays_retryable() -> None:
    # The ledger's store is away: the kernel's client must see an outage it
    # can wait out, not a generic KernelError (which the edge reports as 500).
    error = error_from_rpc(
        _failed(DatabaseUnavailable("ledger store unavailable")),
        KernelError,
        reasons_of(KernelError),
    )
    assert isinstance(error, ServiceUnavailable)
    assert error.message == "ledger store unavailable"


def test_a_known_reason_keeps_its_own_class() -> None:
    error = error_from_rpc(
        _failed(StaleEpoch("fenced", fence="3")), LedgerError, reasons_of(LedgerError)
    )
    assert isinstance(error, StaleEpoch) and error.metadata == {"fence": "3"}
