"""Open event streams by the key they were opened with, ended when it is revoked.

A key is checked once, when its stream opens; an SSE stream or a gRPC
StreamEvents may then stay open for hours. So that a revoked key does not
keep the streams it opened, each stream is registered here under its key's
SHA-256 (what a revocation names, kernel WatchRevocations) for as long as it
is open, and waits for its frames through `OpenStream.next`. When the edge
learns of a revocation (edge/auth.py follows them), `OpenStreams.end_key`
ends every stream of that key: one waiting for frames is interrupted at
once, one busy sending stops before its next frame. The stream then ends in
its door's own words (SSE: a final `revoked` event; gRPC: UNAUTHENTICATED
with the reason API_KEY_REVOKED).

The interruption is an `asyncio.Timeout`, asyncio's cancel scope: rescheduled
to now, it cancels the task waiting inside it and turns exactly that
cancellation into TimeoutError at its exit, leaving any other (the client
left) as it is. A scope only ever spans the wait for the next frames, never
a `yield`: the cancellation must land in the fan-out's wait (which a client
leaving cancels the same way), never in the code that writes the stream out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from edge.errors import EdgeError, Unauthorized, Unavailable

T = TypeVar("T")


class KeyRevoked(Unauthorized):
    """The key a stream was opened with has been revoked since."""

    code = "key_revoked"
    reason = "API_KEY_REVOKED"


class KeyUnconfirmed(Unavailable):
    """More revocations went by between a key's check and the opening of its
    stream than the edge remembers (edge/auth.py): it cannot tell whether
    the key was one of them. Reconnecting checks the key again."""

    reason = "KEY_UNCONFIRMED"


class OpenStream:
    """One open event stream of a key; `with` it to unregister on close."""

    __slots__ = ("_streams", "_waiting", "ended_by", "key_hash")

    def __init__(self, streams: OpenStreams, key_hash: str) -> None:
        self._streams = streams
        self.key_hash = key_hash
        # Why the stream must end (None while it may go on).
        self.ended_by: EdgeError | None = None
        # The scope of the wait for frames under way, if one is.
        self._waiting: asyncio.Timeout | None = None

    def __enter__(self) -> OpenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unregisters the stream (idempotent)."""
        self._streams._forget(self)

    def end(self, error: EdgeError) -> None:
        """Ends the stream with `error` (call on the event loop)."""
        if self.ended_by is not None:
            return
        self.ended_by = error
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.reschedule(asyncio.get_running_loop().time())

    def check(self) -> None:
        """Raises why the stream must end, if it must."""
        if self.ended_by is not None:
            raise self.ended_by

    async def next(self, source: AsyncIterator[T]) -> T | None:
        """The next item of `source` (None once it ends), unless the stream
        is ended first: then raises why (`ended_by`)."""
        self.check()
        scope = asyncio.timeout(None)
        try:
            async with scope:
                self._waiting = scope
                try:
                    return await anext(source, None)
                finally:
                    self._waiting = None
        except TimeoutError:
            if scope.expired() and self.ended_by is not None:
                raise self.ended_by from None
            raise


class OpenStreams:
    """The event streams open on one edge, by the SHA-256 of their key."""

    def __init__(self) -> None:
        self._by_key: dict[str, set[OpenStream]] = {}

    def open(self, key_hash: str) -> OpenStream:
        stream = OpenStream(self, key_hash)
        self._by_key.setdefault(key_hash, set()).add(stream)
        return stream

    def end_key(self, key_hash: str, error: EdgeError) -> int:
        """Ends every open stream of the key; how many there were."""
        streams = self._by_key.pop(key_hash, set())
        for stream in streams:
            stream.end(error)
        return len(streams)

    def count(self, key_hash: str | None = None) -> int:
        """Open streams (of one key's hash, if given)."""
        if key_hash is not None:
            return len(self._by_key.get(key_hash, ()))
        return sum(len(streams) for streams in self._by_key.values())

    @property
    def keys(self) -> int:
        """Keys with an open stream (0 once every stream closed)."""
        return len(self._by_key)

    def _forget(self, stream: OpenStream) -> None:
        streams = self._by_key.get(stream.key_hash)
        if streams is None:
            return
        streams.discard(stream)
        if not streams:
            del self._by_key[stream.key_hash]
