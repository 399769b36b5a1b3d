"""The ports `keel up` will listen on, checked before anything starts.

Every port `keel up` was told to use (the edge's HTTP and gRPC ports, the
internal gRPC ports of `--grpc-base-port`, the metrics ports of
`--metrics-port`) is bound once as a test before any service starts, so a
busy one ends the command with one line naming it and what it was for,
instead of a traceback halfway through the start (or, with `--processes`, an
edge restarted forever). A port taken between the test and the start (the
race) is found again by the same test after the failure and told in the
same line.

With `--grpc-base-port B` the internal services listen on B, B+1, … in
start order: the ledger(s), the kernel(s), the compaction service, then the
runners (`keel up --processes --runners 2 --grpc-base-port 7100`: ledger
7100, kernel 7101, compaction 7102, runner-1 7103, runner-2 7104); a
replaced runner comes back on its predecessor's port. Without it they use
free ports.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

from services.common import settings_registry as registry
from services.common.setting import read_text
from services.service_start import NamedPort, unavailable_reason

INTERNAL_HOST = "127.0.0.1"
HIGHEST_PORT = 65535


class PortPlanError(ValueError):
    """The ports asked for cannot all be used (e.g. two uses of one port)."""


def service_names(runners: int, ledgers: int = 1, kernels: int = 1) -> list[str]:
    """The internal services in start order, as `keel up --processes` names
    its children (one replica keeps the plain name)."""

    def replicas(service: str, count: int) -> list[str]:
        return [service] if count == 1 else [f"{service}-{i + 1}" for i in range(count)]

    return [
        *replicas("ledger", ledgers),
        *replicas("kernel", kernels),
        "compaction",
        *(f"runner-{i + 1}" for i in range(max(runners, 1))),
    ]


def internal_ports(base: int | None, names: Sequence[str]) -> dict[str, int]:
    """Each internal service's gRPC port from `--grpc-base-port` ({}: free ports)."""
    if base is None:
        return {}
    last = base + len(names) - 1
    if last > HIGHEST_PORT:
        raise PortPlanError(
            f"--grpc-base-port {base}: {len(names)} services need ports up to {last}, "
            f"above {HIGHEST_PORT}"
        )
    return {name: base + offset for offset, name in enumerate(names)}


def metrics_host() -> str:
    return read_text(os.environ, registry.KEEL_METRICS_HOST)


def planned_ports(
    host: str,
    http_port: int,
    grpc_port: int,
    internal: dict[str, int],
    metrics: dict[str, int],
) -> list[NamedPort]:
    """Every fixed port of a `keel up` (0: any free port, nothing to check).
    `metrics` is each process's metrics port (embedded: one, named "up")."""
    named = [
        NamedPort(host, http_port, "the HTTP port", "--http-port"),
        NamedPort(host, grpc_port, "the gRPC port", "--grpc-port"),
        *(
            NamedPort(INTERNAL_HOST, port, f"the internal gRPC port of {name}", "--grpc-base-port")
            for name, port in internal.items()
        ),
        *(
            NamedPort(
                metrics_host(),
                port,
                "the metrics port" if name == "up" else f"the metrics port of {name}",
                "--metrics-port",
            )
            for name, port in metrics.items()
        ),
    ]
    fixed = [p for p in named if p.port]
    _refuse_shared(fixed)
    return fixed


def _refuse_shared(ports: Iterable[NamedPort]) -> None:
    seen: dict[int, NamedPort] = {}
    for named in ports:
        first = seen.setdefault(named.port, named)
        if first is not named:
            raise PortPlanError(
                f"port {named.port} would be both {first.use} and {named.use}: "
                f"change {named.flag} or {first.flag}"
            )


# How many ports below the kernel's ephemeral range free_port draws from.
_FREE_SPAN = 10_000
_FREE_TRIES = 100
_given: set[int] = set()
# Its own generator: the global one belongs to whoever seeds it (a property
# test checks that nothing else draws from it while it generates).
_chooser = random.Random()


def free_port() -> int:
    """A loopback port nothing listens on now, for a service without a fixed one.

    Drawn at random below the kernel's ephemeral range: a port from bind(0)
    lies inside it, and until the service binds it (after the services before
    it are ready) the kernel may give it to any outgoing connection, such as
    one of the pools' connections to PostgreSQL, and the service could not
    start. Below the range only an explicit bind can take it."""
    low = _ephemeral_low()
    span = range(max(1024, low - _FREE_SPAN), low)
    if len(_given) > len(span) // 2:
        _given.clear()
    for _ in range(_FREE_TRIES):
        port = _chooser.choice(span)
        # Not one this process handed out already: its service may not listen yet.
        if port not in _given and unavailable_reason(INTERNAL_HOST, port) is None:
            _given.add(port)
            return port
    with socket.socket() as probe:  # that range is full: what the kernel gives
        probe.bind((INTERNAL_HOST, 0))
        return int(probe.getsockname()[1])


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to connections (Linux's default
    when it cannot be read)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return max(1025, int(text.split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768
