"""Hostile and greedy HTTP clients on raw sockets, and an edge with limits.

`limited_edge` starts one more edge on a test stack's ledger, kernel and
compaction service, with the `ClientLimits` a test chooses (short timeouts,
small limits), and stops it afterwards.

The clients speak HTTP/1.1 by hand, as an attacker would: a head sent a
header line at a time (slowloris), a connection that sends nothing, a body
trickled a byte at a time, a body abandoned halfway, many event streams
opened at once. Each is an asyncio connection; `RawClient.closed_by_server`
waits (under a deadline) for the edge to close it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edge.gateway import EdgeConfig
from edge.limits import ClientLimits
from edge.server import EdgeServer

if TYPE_CHECKING:
    from tests.support.edge_stack import Stack


@contextlib.asynccontextmanager
async def limited_edge(stack: Stack, limits: ClientLimits) -> AsyncIterator[EdgeServer]:
    """Another edge on the stack's services, holding `limits`."""
    cluster = stack.cluster
    edge = await EdgeServer(
        cluster.settings,
        EdgeConfig(
            cluster.ledger_server.target,
            cluster.kernel_server.target,
            stack.compaction.target,
            drain_retry_after_ms=250,
            grpc_port=0,
        ),
        limits=limits,
    ).start()
    try:
        yield edge
    finally:
        await edge.stop()


@dataclass
class RawClient:
    """One TCP connection to the edge, written and read by hand."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    received: bytes = b""
    _trickle: asyncio.Task[None] | None = field(default=None, repr=False)

    @classmethod
    async def connect(cls, port: int, host: str = "127.0.0.1") -> RawClient:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def trickle(self, chunk: bytes, every_s: float) -> None:
        """Sends `chunk` every `every_s` seconds until the edge closes the
        connection (the attack itself: the pause between bytes is its pace)."""

        async def go() -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while not self.writer.is_closing():
                    await asyncio.sleep(every_s)
                    self.writer.write(chunk)
                    await self.writer.drain()

        self._trickle = asyncio.create_task(go())

    async def closed_by_server(self, deadline_s: float) -> bytes:
        """Everything the edge sent until it closed the connection; fails
        if it is still open at the deadline."""
        try:
            async with asyncio.timeout(deadline_s):
                while True:
                    try:
                        chunk = await self.reader.read(65536)
                    except ConnectionError:
                        chunk = b""
                    if not chunk:
                        break
                    self.received += chunk
        except TimeoutError:
            raise AssertionError(
                f"the edge kept the connection open for {deadline_s} s; got {self.received!r}"
            ) from None
        await self.close()
        return self.received

    async def read_head(self, deadline_s: float) -> bytes:
        """The status line and headers of the edge's answer."""
        async with asyncio.timeout(deadline_s):
            head = await self.reader.readuntil(b"\r\n\r\n")
        return head

    async def close(self) -> None:
        if self._trickle is not None:
            self._trickle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._trickle
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


def status_of(answer: bytes) -> int:
    """The status code of a raw HTTP answer (0: no answer at all)."""
    if not answer.startswith(b"HTTP/1."):
        return 0
    return int(answer.split(b" ", 2)[1])


def request_head(
    method: str, path: str, key: str | None = None, extra: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    lines += [f"{name}: {value}" for name, value in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def open_stream(port: int, path: str, key: str, deadline_s: float) -> tuple[int, RawClient]:
    """Opens an SSE request (HTTP/1.0: the stream flows unframed); its
    status and the connection, left open for the caller to close."""
    client = await RawClient.connect(port)
    await client.send(
        f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        "Accept: text/event-stream\r\n\r\n".encode()
    )
    head = await client.read_head(deadline_s)
    return status_of(head), client
