"""The streams around an MCP connection: a stdio server's stderr, logged
line by line, and a transport whose end the connection hears of.

The SDK's transports say that a server went away only by ending the read
stream a session is reading; `watched` wraps that stream so the connection
learns it too (and starts a new one on the next use).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
from mcp.client import Transport
from mcp.shared.message import SessionMessage

if TYPE_CHECKING:  # the SDK's own names for these types live in private modules
    from mcp.client._transport import TransportStreams
    from mcp.shared._stream_protocols import ReadStream

__all__ = ["EndWatchingReader", "StderrLog", "watched"]

# How long the server's stderr may stay open after it stopped (a grandchild can hold it).
_STDERR_GRACE_S = 2.0

log = logging.getLogger(__name__)


class StderrLog:
    """Logs each line a child writes on stderr as one record."""

    def __init__(self, transport: asyncio.ReadTransport, task: asyncio.Task[None]) -> None:
        self._transport = transport
        self._task = task

    @classmethod
    async def start(cls, fd: int, label: str) -> StderrLog:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        pipe = os.fdopen(fd, "rb")
        try:
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), pipe
            )
        except BaseException:
            pipe.close()
            raise
        task = asyncio.create_task(cls._pump(reader, label), name=f"mcp-stderr-{label}")
        return cls(transport, task)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, label: str) -> None:
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # asyncio dropped a line longer than the reader's limit
                log.info("%s: [a stderr line over 1 MiB was dropped]", label)
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip("\r\n")
            log.info("%s: %s", label, text, extra={"mcp_server": label})

    async def finish(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_STDERR_GRACE_S):
                await asyncio.shield(self._task)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._transport.close()


class EndWatchingReader:
    """A transport's read stream that reports when it reaches its end."""

    def __init__(self, inner: ReadStream[SessionMessage | Exception], ended: asyncio.Event):
        self._inner = inner
        self._ended = ended

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._ended.set()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> EndWatchingReader:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> EndWatchingReader:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


@asynccontextmanager
async def watched(transport: Transport, ended: asyncio.Event) -> AsyncIterator[TransportStreams]:
    """The transport, with `ended` set when the server side closes the stream."""
    try:
        async with transport as (read_stream, write_stream):
            yield EndWatchingReader(read_stream, ended), write_stream
    finally:
        ended.set()
