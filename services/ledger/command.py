"""`keel ledger` (and `python -m services.ledger`): the ledger alone in this process."""

from __future__ import annotations

from services.service_start import (
    Address,
    DatabaseUrl,
    MetricsPort,
    address_port,
    serve,
    service_settings,
)


def ledger(
    address: Address = "127.0.0.1:7101",
    database_url: DatabaseUrl = None,
    metrics_port: MetricsPort = None,
) -> None:
    """Run the ledger service (session streams, the writer fence)."""
    from services.ledger.server import run_ledger

    settings = service_settings("ledger", database_url)
    ports = address_port(address, "the ledger's port")
    serve("ledger", settings, run_ledger(settings, address), metrics_port, ports)
