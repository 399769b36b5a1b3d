"""Serving and calling Keel's gRPC services, the same way in every process.

Every server gets the standard health service, reflection, OpenTelemetry
tracing, the internal token check and TLS (services/common/internal_auth.py,
when configured); every client channel gets the matching interceptors and
credentials. The embedded `keel up` uses these too, over
loopback, so one process exercises exactly the production code paths.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc import filters as otel_filters

from services.common import hops, tracing
from services.common.config import DEFAULT_GRPC_MAX_MESSAGE_BYTES, Settings
from services.common.internal_auth import (
    TokenServerInterceptor,
    channel_credentials,
    server_credentials,
    tls_material,
    token_interceptors,
)

log = logging.getLogger(__name__)

STREAMING_METHODS = (
    "Subscribe",
    "WatchSession",
    "Attach",
    "Watch",
    "StreamEvents",
    "AppendStream",
    "LeaseStream",
)
# The default; `Settings.grpc_max_message_bytes` (KEEL_GRPC_MAX_MESSAGE_BYTES)
# sets it. Large enough for a batch of facts; the ledger refuses a fact over
# its own limit by name (FACT_TOO_LARGE) before this one is reached, and a
# larger message is refused by gRPC itself (RESOURCE_EXHAUSTED).
MAX_MESSAGE_BYTES = DEFAULT_GRPC_MAX_MESSAGE_BYTES
# What a message needs beyond one fact's JSON (its kind, ids, framing).
MESSAGE_OVERHEAD_BYTES = 64 << 10
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A channel's own connections: from gRPC's process-wide pool, a new
    # channel to an address whose earlier server went away (a restarted
    # service on the same port) would take over that connection's backoff
    # and fail at once with its last "connection refused".
    ("grpc.use_local_subchannel_pool", 1),
]
SERVER_OPTIONS: list[tuple[str, Any]] = [
    # Ping idle peers so a connection that died without a FIN (a crashed
    # host, a partition) is noticed in seconds, e.g. a runner's Attach stream.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


@dataclass(frozen=True)
class GrpcService:
    """One servicer to mount: its full name and how to add it to a server."""

    name: str
    add_to_server: Callable[[grpc.aio.Server], None]
    # Called when the server starts draining, before it stops accepting.
    on_drain: Callable[[], Awaitable[None]] | None = None


class RunningServer:
    """A started gRPC server with its health servicer and bound port."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health: HealthServicer,
        port: int,
        services: Sequence[GrpcService],
    ) -> None:
        self.server = server
        self.health = health
        self.port = port
        self.services = services

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float = 2.0) -> None:
        """Marks NOT_SERVING, lets each service drain, then stops the server."""
        await self.health.enter_graceful_shutdown()
        for service in self.services:
            if service.on_drain is not None:
                await service.on_drain()
        await self.server.stop(grace)


class ServedOnOneAddress:
    """A service process's server once started: `running` is set by its
    `start` and cleared by its `stop`."""

    running: RunningServer | None

    @property
    def target(self) -> str:
        """The address callers reach it at ("127.0.0.1:<port>")."""
        assert self.running is not None
        return self.running.address


class _StartedServer(Protocol):
    @property
    def target(self) -> str: ...

    async def stop(self, grace: float = 2.0) -> None: ...


async def serve_until_cancelled(server: _StartedServer, name: str, logger: logging.Logger) -> None:
    """Says where `server` listens (the "<name> listening on <address>" line
    supervisors and tests wait for), serves until cancelled (SIGINT/SIGTERM),
    then stops it."""
    logger.info("%s listening on %s", name, server.target)
    print(f"{name} listening on {server.target}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def message_size_options(settings: Settings) -> list[tuple[str, Any]]:
    """The largest message sent and received, as gRPC options. Refuses a
    limit that a fact at the ledger's own limit could not pass."""
    limit = settings.grpc_max_message_bytes
    if limit < settings.max_fact_bytes + MESSAGE_OVERHEAD_BYTES:
        raise ValueError(
            f"KEEL_GRPC_MAX_MESSAGE_BYTES ({limit}) must be at least KEEL_MAX_FACT_BYTES "
            f"({settings.max_fact_bytes}) + {MESSAGE_OVERHEAD_BYTES}"
        )
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


class CallCounter(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts every RPC a server receives, by method (services/common/hops.py).

    Once per call, whether unary or streaming: a stream's own messages are
    counted by its servicer, which alone knows what a message is worth."""

    def __init__(self) -> None:
        # "/pkg.Service/Method" -> "pkg.Service/Method", sliced once per name.
        self._names: dict[str, str] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        method = handler_call_details.method
        name = self._names.get(method)
        if name is None:
            name = self._names.setdefault(method, method.lstrip("/"))
        hops.called(name)
        return await continuation(handler_call_details)


def _traced_methods() -> Any:
    # Long-lived streams are not traced: a span per subscription says nothing,
    # and the instrumentation cannot detach its context when a client cancels.
    untraced = otel_filters.any_of(*(otel_filters.method_name(name) for name in STREAMING_METHODS))
    return otel_filters.negate(untraced)


async def serve_services(
    services: Sequence[GrpcService],
    address: str,
    settings: Settings,
    *,
    public: bool = False,
    options: Sequence[tuple[str, Any]] = (),
) -> RunningServer:
    """Starts one aio server hosting `services` on `address` ("host:port").
    An internal server checks the internal token (when set) on every call but
    health, and serves TLS when configured. A `public` server's callers hold
    API keys, which its services check, and its transport is plain (TLS is
    terminated in front of the edge). `options` are added to the server's."""
    interceptors: list[Any] = []
    if settings.tracing:
        interceptors.append(aio_server_interceptor(filter_=_traced_methods()))
    # First, so a refused call is never traced nor reaches anything else.
    if settings.internal_token and not public:
        interceptors.insert(0, TokenServerInterceptor(settings.internal_token))
    # Before all: a call refused by the token check was still received.
    interceptors.insert(0, CallCounter())
    # Read before anything starts: a half-configured TLS fails here, whole.
    material = None if public else tls_material(settings)
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[*SERVER_OPTIONS, *message_size_options(settings), *options],
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for service in services:
        service.add_to_server(server)
    names = [s.name for s in services]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    if material is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, server_credentials(material))
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    await server.start()
    for name in names:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on port %d", ", ".join(names), port)
    return RunningServer(server, health, port, services)


def open_channel(
    address: str, settings: Settings, extra_options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An aio channel to an internal Keel service: tracing when spans go
    somewhere, the internal token on every kind of call, TLS when configured.
    `extra_options` are added to the channel's options (e.g. a service
    config). Raises InternalAuthError for a half-configured TLS."""
    interceptors: list[Any] = []
    if settings.tracing:
        interceptors.extend(
            aio_client_interceptors(
                filter_=_traced_methods(), request_hook=tracing.request_attributes
            )
        )
    if settings.internal_token:
        interceptors.extend(token_interceptors(settings.internal_token))
    material = tls_material(settings)
    options = [*CHANNEL_OPTIONS, *message_size_options(settings), *extra_options]
    if material is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if settings.grpc_tls_server_name:
        options.append(("grpc.ssl_target_name_override", settings.grpc_tls_server_name))
    return grpc.aio.secure_channel(
        address, channel_credentials(material), options=options, interceptors=interceptors
    )
