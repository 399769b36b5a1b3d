"""Serving the edge, embedded in `keel up` or alone (`keel edge`): the HTTP
API with uvicorn and, when `EdgeConfig.grpc_port` is set, the public gRPC API
(keel.sessions.v1) with health and reflection, both on one gateway.

Both doors share one `Guards` (edge/limits.py): failed keys are counted per
client address whichever door they come through, and event streams per key
and tenant over SSE and gRPC together. `ClientLimits` come from `KEEL_EDGE_*`
unless given. uvicorn runs its httptools protocol with a deadline and a size
limit for request heads (edge/slow_clients.py), the gRPC server with the same
limit on metadata, and idle connections are kept longer than load balancers
keep theirs (`ClientLimits.keep_alive_s`); X-Forwarded-For is believed only from the
proxies `ClientLimits.trusted_proxies` names (uvicorn would otherwise believe
it from loopback, where anyone could use it to dodge the per-address limit).

A standalone edge (`keel edge`) runs its event loop on uvloop
(services/common/event_loop.py says where and why).

An edge records itself under the data dir (services/common/runtime_records.py)
so `keel drain --local` can find it; once such a drain has finished, a
standalone edge exits 0 and is replaced, like a runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from edge.app import create_app
from edge.gateway import EdgeConfig, Gateway
from edge.grpc_api import session_service
from edge.limits import ClientLimits, Guards
from edge.refusals import REFUSALS
from edge.runtime_status import attach_edge, services_answer
from edge.slow_clients import guarded_protocol
from services.blobs import blob_store
from services.common.config import Settings
from services.common.runtime_records import forget_runtime, local_dial_address, record_runtime
from services.common.serving import RunningServer, serve_services

log = logging.getLogger(__name__)
T = TypeVar("T")


class EdgeServer:
    def __init__(
        self,
        settings: Settings,
        config: EdgeConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ClientLimits | None = None,
    ):
        self.settings = settings
        self.config = config
        self.limits = limits if limits is not None else ClientLimits.from_env()
        self.guards = Guards.of(self.limits)
        self.host = host
        self.port = port
        self.gateway: Gateway | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self._grpc: RunningServer | None = None
        self._record: Path | None = None
        self._unwatch: Callable[[], None] = lambda: None

    async def start(self) -> EdgeServer:
        blobs = await asyncio.to_thread(blob_store, self.settings)
        self.gateway = Gateway(self.config, self.settings, blobs)
        self.gateway.auth.follow_revocations()
        app = create_app(self.gateway, self.guards)
        if self.config.grpc_port is not None:
            self._grpc = await serve_services(
                [session_service(self.gateway, self.guards)],
                f"{self.host}:{self.config.grpc_port}",
                self.settings,
                public=True,
                options=metadata_limits(self.limits),
            )
        # Bind ourselves so port 0 works and the real port is known at once.
        # The protocol must be named: asyncio turns Nagle's algorithm off only
        # for sockets whose proto is IPPROTO_TCP, and with Nagle on, a response
        # written in two parts waits for the client's delayed ACK (~40 ms) on
        # every keep-alive request.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((self.host, self.port))
        self.port = self._socket.getsockname()[1]
        proxies = list(self.limits.trusted_proxies)
        config = uvicorn.Config(
            app,
            http=guarded_protocol(self.limits),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            proxy_headers=bool(proxies),
            forwarded_allow_ips=proxies or None,
            server_header=False,
            # uvicorn's default (5 s) equals common clients' pool expiry:
            # a request sent as the edge closes the idle connection fails.
            timeout_keep_alive=math.ceil(self.limits.keep_alive_s),
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        self._record = record_runtime(
            self.settings.data_dir,
            self.gateway.edge_id,
            "edge",
            local_dial_address(self.host, self.port),
        )
        # Listed by every edge's status, like a runner (edge.runtime_status).
        attach_edge(self.gateway, local_dial_address(self.host, self.port))
        self._unwatch = REFUSALS.watch_with(functools.partial(services_answer, self.gateway))
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def keep_alive_s(self) -> float:
        """How long uvicorn keeps an idle connection open between requests."""
        assert self._server is not None
        return float(self._server.config.timeout_keep_alive)

    @property
    def grpc_address(self) -> str | None:
        """host:port of the gRPC API (None when not served)."""
        if self._grpc is None:
            return None
        return f"{self.host}:{self._grpc.port}"

    async def stop(self) -> None:
        self._unwatch()
        if self._record is not None:
            forget_runtime(self._record)
        if self.gateway is not None:
            self.gateway.start_draining()  # SSE clients get `drain`, then streams end
        if self._server is not None:
            self._server.should_exit = True
        if self._grpc is not None:
            # Streams have been sent their Drain; in-flight unary calls finish.
            await self._grpc.stop(grace=2.0)
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        if self._socket is not None:
            self._socket.close()
        if self.gateway is not None:
            await self.gateway.close()


def metadata_limits(limits: ClientLimits) -> list[tuple[str, Any]]:
    """The gRPC door's limit on a call's metadata (its head), the HTTP
    door's: gRPC's own defaults (8 KiB soft, 16 KiB hard) refuse a call
    between the two at random. With both at one value, a call over it is
    refused every time (RESOURCE_EXHAUSTED, "received metadata size exceeds
    hard limit"); HPACK counts 32 bytes more per entry, which bounds their
    number as well."""
    return [
        ("grpc.max_metadata_size", limits.max_head_bytes),
        ("grpc.absolute_max_metadata_size", limits.max_head_bytes),
    ]


async def run_edge(settings: Settings, config: EdgeConfig, host: str, port: int) -> None:
    """Serves until SIGINT/SIGTERM, or until a drain of this edge has
    finished (then exits 0: the edge is replaced); SSE clients get `drain`
    and the listener closes."""
    import signal

    server = await EdgeServer(settings, config, host, port).start()
    assert server.gateway is not None
    print(f"edge {server.gateway.edge_id} listening on {host}:{server.port}", flush=True)
    if server.grpc_address is not None:
        print(f"gRPC API: {server.grpc_address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    signalled = asyncio.ensure_future(stop.wait())
    drained = asyncio.ensure_future(server.gateway.drained.wait())
    try:
        await asyncio.wait({signalled, drained}, return_when=asyncio.FIRST_COMPLETED)
        if server.gateway.drained.is_set():
            print(f"edge {server.gateway.edge_id} drained; exiting", flush=True)
    finally:
        for waiter in (signalled, drained):
            waiter.cancel()
        await server.stop()
