"""`keel compaction` (and `python -m compaction`): the compaction service alone."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from services.common import settings_registry as registry
from services.common.setting import read_int
from services.service_start import (
    Address,
    DatabaseUrl,
    MetricsPort,
    address_port,
    serve,
    service_settings,
)


def compaction(
    ledger: Annotated[str, typer.Option("--ledger")] = "127.0.0.1:7101",
    kernel: Annotated[str, typer.Option("--kernel")] = "127.0.0.1:7102",
    address: Address = "127.0.0.1:7103",
    database_url: DatabaseUrl = None,
    metrics_port: MetricsPort = None,
) -> None:
    """Run the compaction service alone (runners embed one unless told otherwise)."""
    from compaction.server import run_compaction

    settings = service_settings("compaction", database_url)
    # The window assumed for a loadout that names none, as the runners do.
    window = read_int(os.environ, registry.KEEL_CONTEXT_WINDOW)
    serve(
        "compaction",
        settings,
        run_compaction(settings, address, ledger, kernel, default_context_window=window),
        metrics_port,
        address_port(address, "the compaction service's port"),
    )
