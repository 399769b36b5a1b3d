"""The runners and the edge of an embedded `keel up`, replaced when drained.

A runtime is replaced, never revived: once a drain of one has finished, it
is stopped and a new one (a new runtime id) takes its place in this process,
as the supervisor of `keel up --processes` starts a new child.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from services.common.config import Settings
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer


class EmbeddedRunners:
    """The runners of an embedded `keel up`: one whose drain has finished is
    stopped, and a new runner takes its place."""

    def __init__(self, settings: Settings, config: RunnerConfig, addresses: list[str]) -> None:
        self.settings = settings
        self.config = config
        # One runner per address (host:0: any free port); a successor takes
        # its predecessor's address.
        self.addresses = addresses or ["127.0.0.1:0"]
        self.runners: list[RunnerServer] = []
        self._watchers: set[asyncio.Task[None]] = set()

    async def start(self) -> EmbeddedRunners:
        for address in self.addresses:
            self._watch(await self._start_one(address))
        return self

    async def _start_one(self, address: str) -> RunnerServer:
        runner = RunnerServer(self.settings, self.config, address)
        try:
            return await runner.start()
        except BaseException:
            await runner.stop()  # what a half-done start left running
            raise

    def _watch(self, runner: RunnerServer) -> None:
        self.runners.append(runner)
        watcher = asyncio.create_task(self._replace_when_drained(runner))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _replace_when_drained(self, runner: RunnerServer) -> None:
        assert runner.runtime is not None
        await runner.runtime.finished.wait()
        self.runners.remove(runner)
        await runner.stop()
        successor = await self._start_one(runner.address)
        print(
            f"  runner {runner.runtime_id} drained; replaced by {successor.runtime_id}", flush=True
        )
        self._watch(successor)

    async def drain(self, mode: str) -> None:
        """Drains every runner (shutting down: none is replaced)."""
        await self._stop_watching()
        await asyncio.gather(
            *(
                r.runtime.drain(mode, self.config.handoff_deadline_ms)
                for r in self.runners
                if r.runtime is not None
            )
        )

    async def _stop_watching(self) -> None:
        for watcher in list(self._watchers):
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    async def stop(self) -> None:
        await self._stop_watching()
        for runner in self.runners:
            await runner.stop()


class EmbeddedEdge:
    """The edge of an embedded `keel up`: one whose drain has finished is
    stopped and a new edge started on the same ports."""

    def __init__(self, settings: Settings, config: EdgeConfig, host: str, port: int) -> None:
        self.settings = settings
        self.config = config
        self.host = host
        self.port = port
        self.edge: EdgeServer | None = None
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> EmbeddedEdge:
        server = EdgeServer(self.settings, self.config, self.host, self.port)
        try:
            edge = await server.start()
        except BaseException:
            await server.stop()  # e.g. its gRPC API served, its HTTP port taken
            raise
        # The ports chosen (0: any) are kept for every successor.
        self.port = edge.port
        if edge.grpc_address is not None:
            self.config = replace(self.config, grpc_port=int(edge.grpc_address.rpartition(":")[2]))
        self.edge = edge
        self._watcher = asyncio.create_task(self._replace_when_drained(edge))
        return self

    async def _replace_when_drained(self, edge: EdgeServer) -> None:
        assert edge.gateway is not None
        await edge.gateway.drained.wait()
        await edge.stop()
        await self.start()
        assert self.edge is not None and self.edge.gateway is not None
        print(f"  edge {edge.gateway.edge_id} drained; replaced by {self.edge.gateway.edge_id}")

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self.edge is not None:
            await self.edge.stop()
