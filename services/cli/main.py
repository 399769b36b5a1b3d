"""`keel`: run Keel's services, talk to them, and measure them.

keel up                    every service in one process (SQLite, offline model, web page)
keel ledger|kernel|…       one service in this process
keel chat|status|drain     clients of the edge (they find a running `keel up` by themselves)
keel loadout|tenants|keys  a tenant's configuration, through the edge
keel bench ledger|…        a benchmark; prints one JSON object
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import replace
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated

import typer

from compaction.command import compaction as compaction_command
from services.cli.admin import keys_app, loadout_app, tenants_app
from services.cli.client_commands import chaos, chat, drain, status
from services.cli.config_command import show_config
from services.cli.discovery import USAGE_EXIT, discovery_path, fail
from services.common import event_loop
from services.common import settings_registry as registry
from services.common.heap import settle_heap
from services.common.setting import read_text
from services.ledger.command import ledger as ledger_command
from services.runner.command import runner as runner_command
from services.service_start import (
    PRIVATE_UMASK,
    Address,
    DatabaseUrl,
    MetricsPort,
    NamedPort,
    PortUnavailable,
    address_port,
    check_ports,
    configure_telemetry,
    serve,
    service_settings,
    settings_from_env,
)

app = typer.Typer(
    name="keel",
    help="Keel: a durable runtime for long-running LLM agent sessions.",
    no_args_is_help=True,
    add_completion=False,
)
# Command groups other packages add (`keel bench …`, from bench/cli.py),
# found by their entry point: the CLI imports nothing of the parts above it.
for _group in entry_points(group="keel.commands"):
    app.add_typer(_group.load(), name=_group.name)
app.add_typer(loadout_app, name="loadout")
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
app.command("config")(show_config)

GrpcPort = Annotated[
    int,
    typer.Option("--grpc-port", min=0, help="port of the public gRPC API (0: any free port)"),
]


# The services' own commands (also what each one's `python -m` runs).
app.command("ledger")(ledger_command)


@app.command()
def kernel(
    address: Address = "127.0.0.1:7102",
    ledger: Annotated[str, typer.Option("--ledger", help="ledger address")] = "127.0.0.1:7101",
    database_url: DatabaseUrl = None,
    metrics_port: MetricsPort = None,
) -> None:
    """Run the kernel service (leases, epochs, queue, admission, tenants)."""
    from kernel import run_kernel

    settings = service_settings("kernel", database_url)
    ports = address_port(address, "the kernel's port")
    serve("kernel", settings, run_kernel(settings, address, ledger), metrics_port, ports)


app.command("runner")(runner_command)
app.command("compaction")(compaction_command)


@app.command()
def edge(
    ledger: Annotated[str, typer.Option("--ledger")] = "127.0.0.1:7101",
    kernel: Annotated[str, typer.Option("--kernel")] = "127.0.0.1:7102",
    compaction: Annotated[
        str, typer.Option("--compaction", help="compaction service address (for /context)")
    ] = "127.0.0.1:7103",
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    http_port: Annotated[int, typer.Option("--http-port")] = 8080,
    grpc_port: GrpcPort = 8081,
    database_url: DatabaseUrl = None,
    metrics_port: MetricsPort = None,
) -> None:
    """Run the edge gateway (HTTP API, SSE, blobs, the web page, the gRPC API)."""
    from edge.gateway import EdgeConfig
    from edge.server import run_edge
    from services.runner.config import drain_deadline_ms

    settings = service_settings("edge", database_url)
    try:
        deadline = drain_deadline_ms()
    except ValueError as error:
        fail(f"keel edge: {error}", USAGE_EXIT)
    config = EdgeConfig(ledger, kernel, compaction, grpc_port=grpc_port, drain_deadline_ms=deadline)
    ports = [
        NamedPort(host, http_port, "the HTTP port", "--http-port"),
        NamedPort(host, grpc_port, "the gRPC port", "--grpc-port"),
    ]
    ports = [p for p in ports if p.port]
    serve("edge", settings, run_edge(settings, config, host, http_port), metrics_port, ports)


@app.command()
def up(
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="SQLite files (default ./.keel)")
    ] = None,
    database_url: DatabaseUrl = None,
    http_port: Annotated[int, typer.Option("--http-port")] = 8080,
    grpc_port: GrpcPort = 8081,
    processes: Annotated[
        bool | None,
        typer.Option(
            "--processes/--embedded",
            help="each service as its own OS process, or all in this one "
            "(default: processes on PostgreSQL, embedded on SQLite)",
            show_default=False,
        ),
    ] = None,
    runners: Annotated[int, typer.Option("--runners", help="runner processes")] = 1,
    ledgers: Annotated[
        int,
        typer.Option(
            "--ledgers", min=1, help="ledger replicas (--processes, PostgreSQL only above 1)"
        ),
    ] = 1,
    kernels: Annotated[
        int,
        typer.Option(
            "--kernels", min=1, help="kernel replicas (--processes, PostgreSQL only above 1)"
        ),
    ] = 1,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="the default tenant's model, e.g. openai:gpt-4.1-mini or anthropic:<name> "
            "(key from OPENAI_API_KEY / ANTHROPIC_API_KEY)",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=1,
            max=65535,
            envvar="KEEL_METRICS_PORT",
            help="Prometheus metrics on this port; with --processes every child has its "
            "own port (this one and the next ones; without it, free ports)",
        ),
    ] = None,
    grpc_base_port: Annotated[
        int | None,
        typer.Option(
            "--grpc-base-port",
            min=1,
            max=65535,
            envvar="KEEL_GRPC_BASE_PORT",
            help="internal gRPC ports from this one up, in the order ledger(s), kernel(s), "
            "compaction, runners (default: free ports)",
        ),
    ] = None,
) -> None:
    """Start everything: ledger, kernel, runner, compaction, edge and the web page.

    One `keel up` per data dir; every port it is given is checked before anything starts."""
    from agent_io.tools.tool_tokens import ToolTokens
    from kernel.tenancy import key_weakness
    from services.cli.data_dir import DataDirInUse, lock_data_dir, with_internal_token
    from services.cli.supervisor import Supervisor, replica_refusal
    from services.cli.up import (
        ModelChoiceError,
        UpFailed,
        UpOptions,
        data_dir_settings,
        default_processes,
        fixed_ports_of,
        model_from_flag,
        model_secrets,
        up_embedded,
    )
    from services.cli.up_ports import PortPlanError
    from services.common.internal_auth import InternalAuthError, require_internal_auth

    # The dev key is an operator key: refused before anything starts if weak.
    dev_key = read_text(os.environ, registry.KEEL_DEV_KEY)
    weakness = key_weakness(dev_key) if dev_key else None
    if weakness is not None:
        fail(f"keel: KEEL_DEV_KEY: {weakness}", USAGE_EXIT)
    try:  # the runners' tool tokens (agent_io.tools.tool_tokens), before anything starts
        ToolTokens.from_env(os.environ)
    except ValueError as error:
        fail(f"keel up: {error}", USAGE_EXIT)
    try:
        chosen_model = model_from_flag(model) if model else None
    except ModelChoiceError as error:
        fail(f"keel: {error}", USAGE_EXIT)
    settings = data_dir_settings(settings_from_env(database_url), data_dir)
    if processes is None:
        processes = default_processes(settings)
    try:
        # Held until this process ends: a second `keel up` here is refused.
        lock_data_dir(settings.data_dir)
    except DataDirInUse as error:
        fail(f"keel up: {error}")
    # What a killed `keel up` announced points nowhere now.
    discovery_path(settings.data_dir).unlink(missing_ok=True)
    try:
        settings = with_internal_token(settings)
        require_internal_auth(settings)
    except (InternalAuthError, OSError) as error:
        # OSError: the token file cannot be made or read (e.g. a symlink there).
        fail(f"keel up: {error}", USAGE_EXIT)
    if chosen_model is not None:
        settings = settings.with_overrides(secrets=model_secrets(settings.secrets, chosen_model))
    options = UpOptions(
        http_port=http_port,
        grpc_port=grpc_port,
        processes=processes,
        runners=runners,
        ledgers=ledgers,
        kernels=kernels,
        dev_key=dev_key,
        model=chosen_model,
        grpc_base_port=grpc_base_port,
    )
    refusal = replica_refusal(options, settings)
    if refusal is not None:
        fail(f"keel up: {refusal}", USAGE_EXIT)
    try:
        options = replace(options, fixed_ports=tuple(fixed_ports_of(options, metrics_port)))
    except PortPlanError as error:
        fail(f"keel up: {error}", USAGE_EXIT)
    try:
        check_ports(options.fixed_ports)
    except PortUnavailable as error:
        fail(f"keel up: {error}")
    # With --processes each child serves its own metrics (the supervisor
    # chooses the ports); the supervisor itself records none. Embedded, the
    # process's metrics are recorded even without a port: the edge's
    # /metrics serves them all.
    if processes:
        configure_telemetry("up", "up", settings, None)
    else:
        configure_telemetry("up", "up", settings, metrics_port, always_recorded=True)
    main_coro = (
        Supervisor(settings, options, metrics_port).run()
        if processes
        else up_embedded(settings, options)
    )
    settle_heap()
    try:
        with contextlib.suppress(KeyboardInterrupt):
            # The embedded runner runs attempts; with --processes this is only
            # the supervisor (each child picks its own loop).
            event_loop.run(main_coro, runs_attempts=True)
    except (UpFailed, PortUnavailable) as error:
        fail(f"keel up: {error}")


# The clients of a running Keel (services/cli/client_commands.py).
for client_command in (chat, drain, status, chaos):
    app.command()(client_command)


def main() -> None:
    # Before anything is created: SQLite files, blobs, the discovery file and
    # the internal token are the owner's alone (0600, folders 0700).
    os.umask(PRIVATE_UMASK)
    try:
        app()
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":
    main()
