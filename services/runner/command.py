"""`keel runner` (and `python -m services.runner`): a runner in this process."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from services.service_start import (
    USAGE_EXIT,
    Address,
    DatabaseUrl,
    MetricsPort,
    address_port,
    fail,
    serve,
    service_settings,
)


def runner(
    ledger: Annotated[str, typer.Option("--ledger")] = "127.0.0.1:7101",
    kernel: Annotated[str, typer.Option("--kernel")] = "127.0.0.1:7102",
    address: Address = "127.0.0.1:0",
    advertise_address: Annotated[
        str,
        typer.Option(
            "--advertise-address",
            envvar="KEEL_ADVERTISE_ADDRESS",
            help="host[:port] others dial to reach this runner, when not --address "
            "(required with a wildcard --address such as 0.0.0.0:7105)",
        ),
    ] = "",
    database_url: DatabaseUrl = None,
    metrics_port: MetricsPort = None,
) -> None:
    """Run a runner (claim loop, model providers, tools) with its compaction service.

    It exits 0 once drained (`keel drain`): a runner is replaced, never revived."""
    from services.runner.config import RunnerConfig
    from services.runner.server import check_addresses, run_runner

    settings = service_settings("runner", database_url)
    try:
        config = RunnerConfig.from_env(ledger, kernel)
        config = replace(config, advertise_address=advertise_address)
        check_addresses(address, advertise_address)
    except ValueError as error:
        fail(f"keel runner: {error}", USAGE_EXIT)
    ports = address_port(address, "the runner's port")
    serve("runner", settings, run_runner(settings, config, address), metrics_port, ports)
