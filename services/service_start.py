"""Starting one Keel service in this process, and what it checks first.

`keel ledger|kernel|runner|compaction|edge` and a service's own
`python -m …` start it through here, so both refuse the same things with the
same one line: no internal token or mutual TLS (exit 2), a port something
else listens on, a metrics port that cannot be bound. The data dir is made
the owner's alone (0700) before anything is written in it, the process's
telemetry is set up, and the service runs until SIGTERM or SIGINT.

Below every service in the layer contract (tests/test_import_directions.py):
it imports only services.common; the service itself is the coroutine the
caller passes, and the instruments primed are named, not imported, here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import os
import signal
import socket
import stat
import sys
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from services.common import event_loop, telemetry
from services.common import settings_registry as registry
from services.common.config import Settings
from services.common.heap import settle_heap
from services.common.metrics_endpoint import MetricsEndpoint
from services.common.runtime_records import split_host_port
from services.common.setting import read_text

# Exit code of a usage error (as typer/click use): the command never ran.
USAGE_EXIT = 2
# Whatever Keel's commands create (SQLite files, blobs, the discovery file,
# the internal token) is the owner's alone: 0600 files in 0700 folders.
PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700

DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", envvar="KEEL_DATABASE_URL", help="PostgreSQL URL"),
]
Address = Annotated[str, typer.Option("--address", help="host:port to listen on")]
MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        min=1,
        max=65535,
        envvar="KEEL_METRICS_PORT",
        help="serve this process's Prometheus metrics on this port (off unless set; "
        "host: KEEL_METRICS_HOST, default 127.0.0.1)",
    ),
]

# Each service's instruments, primed (counters at 0) once the meter provider
# is set; a runner embeds a compaction service, `keel up` runs them all.
# Imported by name when that service starts in this process.
METRICS_MODULES = {
    "ledger": ("services.ledger.metrics",),
    "kernel": ("kernel.metrics",),
    "runner": ("services.runner.metrics", "compaction.metrics"),
    "compaction": ("compaction.metrics",),
    "edge": ("edge.metrics",),
}
METRICS_MODULES["up"] = tuple(m for ms in METRICS_MODULES.values() for m in ms)


def fail(message: str, code: int = 1) -> NoReturn:
    """Ends the command with one line on stderr: no traceback for users."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


def close_data_dir(data_dir: Path) -> None:
    """Makes an existing data dir 0700 (one made under a looser umask, or by
    an older Keel); a missing one is left to be created under umask 077."""
    with contextlib.suppress(FileNotFoundError):
        if data_dir.is_dir() and stat.S_IMODE(data_dir.stat().st_mode) != PRIVATE_DIR_MODE:
            data_dir.chmod(PRIVATE_DIR_MODE)


@dataclass(frozen=True)
class NamedPort:
    """A port `keel up` will listen on, and what for (for the one line)."""

    host: str
    port: int
    # "the HTTP port", "the internal gRPC port of kernel", …
    use: str
    # The flag that chooses it, for the hint.
    flag: str


class PortUnavailable(Exception):
    """A port `keel up` needs cannot be listened on (its message is the line to show)."""

    def __init__(self, named: NamedPort, reason: str) -> None:
        self.named = named
        super().__init__(
            f"port {named.port} ({named.use}) {reason}: stop what listens there "
            f"or choose another with {named.flag}"
        )


def unavailable_reason(host: str, port: int) -> str | None:
    """Why nothing can listen on host:port now, or None when it can.

    The test binds as the servers do (SO_REUSEADDR: a port left in TIME_WAIT
    by an earlier run is free) and listens: only a listener there refuses."""
    bind_host = host.strip("[]") or None
    try:
        infos = socket.getaddrinfo(
            bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as error:
        return f"cannot be listened on at {host!r}: {error.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
            probe.listen(1)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return "is in use"
            return f"cannot be listened on at {host or '*'}: {error.strerror}"
    return None


def first_unavailable(ports: Iterable[NamedPort]) -> PortUnavailable | None:
    """The first of `ports` nothing could listen on now, as the error to raise."""
    for named in ports:
        reason = unavailable_reason(named.host, named.port)
        if reason is not None:
            return PortUnavailable(named, reason)
    return None


def check_ports(ports: Iterable[NamedPort]) -> None:
    """Raises PortUnavailable for the first port that cannot be listened on."""
    unavailable = first_unavailable(ports)
    if unavailable is not None:
        raise unavailable


def settings_from_env(database_url: str | None = None) -> Settings:
    try:
        settings = Settings.from_env()
    except ValueError as error:
        fail(f"keel: {error}", USAGE_EXIT)
    if database_url is not None:
        settings = settings.with_overrides(database_url=database_url)
    return settings


def service_settings(service: str, database_url: str | None) -> Settings:
    """Settings for `keel <service>`, which will not start open: without an
    internal token or mutual TLS it ends with exit code 2 and one line."""
    from services.common.internal_auth import InternalAuthError, require_internal_auth

    settings = settings_from_env(database_url)
    try:
        require_internal_auth(settings)
    except InternalAuthError as error:
        fail(f"keel {service}: {error}", USAGE_EXIT)
    close_data_dir(Path(settings.data_dir))
    return settings


async def until_signalled(main: Coroutine[Any, Any, None]) -> None:
    """Runs `main`; SIGTERM or SIGINT cancels it, so its clean-up runs and
    the process exits 0 (a service that handles the signals itself, as the
    runner and the edge do, replaces these handlers with its own)."""
    task = asyncio.ensure_future(main)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _metrics_endpoint(port: int | None, always_recorded: bool) -> MetricsEndpoint | None:
    if port is None and not always_recorded:
        return None
    host = read_text(os.environ, registry.KEEL_METRICS_HOST)
    return MetricsEndpoint(host, port)


def configure_telemetry(
    command: str,
    service: str,
    settings: Settings,
    metrics_port: int | None,
    *,
    always_recorded: bool = False,
) -> None:
    """Telemetry of this process; a metrics port that cannot be bound ends it
    with one line, before the service starts. `always_recorded`: the
    process's metrics are recorded (for the edge's /metrics) without a port too."""
    try:
        telemetry.configure(service, settings, _metrics_endpoint(metrics_port, always_recorded))
    except OSError as error:
        fail(f"keel {command}: cannot serve metrics on port {metrics_port}: {error}", USAGE_EXIT)
    for module in METRICS_MODULES.get(service, ()):
        importlib.import_module(module).prime()


def serve(
    service: str,
    settings: Settings,
    main: Coroutine[Any, Any, None],
    metrics_port: int | None = None,
    ports: Sequence[NamedPort] = (),
) -> None:
    """Runs one service; `ports` (what it listens on) are checked first,
    and again if it fails to start, so a busy one is told in one line."""
    try:
        check_ports(ports)
        configure_telemetry(service, service, settings, metrics_port)
    except PortUnavailable as error:
        main.close()
        fail(f"keel {service}: {error}")
    except BaseException:
        main.close()  # never started: no "never awaited" warning on the way out
        raise
    settle_heap()
    try:
        with contextlib.suppress(KeyboardInterrupt):
            event_loop.run(until_signalled(main), runs_attempts=service == "runner")
    except (OSError, RuntimeError):
        # A port taken since the check (gRPC says RuntimeError).
        unavailable = first_unavailable(ports)
        if unavailable is None:
            raise
        fail(f"keel {service}: {unavailable}")


def address_port(address: str, use: str) -> list[NamedPort]:
    """The port of `--address host:port` to check (none for port 0 or a bad address,
    which the service reports itself)."""
    try:
        host, port = split_host_port(address)
    except ValueError:
        return []
    return [NamedPort(host, port, use, "--address")] if port else []


def run_alone(command: Callable[..., None], prog_name: str) -> None:
    """`python -m <service>`: the service's command as a program of its own,
    with the options, checks and umask of `keel <service>`."""
    os.umask(PRIVATE_UMASK)
    app = typer.Typer(add_completion=False)
    app.command()(command)
    try:
        app(prog_name=prog_name)
    except BrokenPipeError:
        sys.exit(0)
