"""`KeelClient`: the blocking client, for scripts and threads without asyncio.

It runs an `AsyncKeelClient` on an event loop of its own, in one daemon
thread, and waits for each call. The alternative, grpc's blocking stubs,
would mean a second implementation of the part that is hard to get right:
the events iterator's reconnect, backoff and seq checks. With one
implementation the blocking iterator has exactly the async one's guarantees
and is tested by the same tests; the cost is one thread per client.

Calls may come from any thread except the client's own loop thread (so
never from a callback running on it). A blocking call from inside a
coroutine blocks that coroutine's event loop: use `AsyncKeelClient` there,
or `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncGenerator, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

from keel_client._async_client import AsyncKeelClient
from keel_client._config import ClientOptions
from keel_client._errors import ClientClosed
from keel_client._types import (
    Cancellation,
    Context,
    Decision,
    Event,
    Input,
    Loadout,
    Schedule,
    Session,
    SessionPage,
    SessionSummary,
    Skip,
)

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop.run_forever, name="keel-client")
        self._thread.daemon = True
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("a KeelClient call from its own event loop thread would deadlock")
        if self._stopping:
            coroutine.close()
            raise ClientClosed("the client is closed")
        return self._wait(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    @staticmethod
    def _wait(future: concurrent.futures.Future[T]) -> T:
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            # close() from another thread cancelled what this call waited on.
            raise ClientClosed("the client was closed while this call waited") from None
        except BaseException:
            # Interrupted (KeyboardInterrupt) or failed: never leave the call
            # running behind the caller's back.
            future.cancel()
            raise

    def stop(self) -> None:
        async def shutdown() -> None:
            current = asyncio.current_task()
            pending = [task for task in asyncio.all_tasks() if task is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            # Iterators the caller dropped without closing: close them here.
            await self._loop.shutdown_asyncgens()

        self._stopping = True
        self._wait(asyncio.run_coroutine_threadsafe(shutdown(), self._loop))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class _ClosedOnExit:
    """`with` closes it, however the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SyncIterator(_ClosedOnExit, Iterator[T]):
    """A blocking view of one of the async client's iterators."""

    def __init__(self, loop: _LoopThread, source: AsyncGenerator[T, None]) -> None:
        self._loop = loop
        self._source = source

    def __iter__(self) -> SyncIterator[T]:
        return self

    def __next__(self) -> T:
        async def step() -> T:
            return await anext(self._source)

        try:
            return self._loop.run(step())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """Stops iterating (closes the stream behind it)."""
        # A closed client has closed every stream already.
        with contextlib.suppress(ClientClosed):
            self._loop.run(self._source.aclose())


class KeelClient(_ClosedOnExit):
    """The blocking twin of `AsyncKeelClient`: same arguments, same results,
    same errors. Use as `with KeelClient(...) as keel:` or call `close()`."""

    def __init__(self, address: str, key: str, *, options: ClientOptions | None = None) -> None:
        self._loop = _LoopThread()

        async def connect() -> AsyncKeelClient:
            # The channel belongs to the loop it is made on.
            return AsyncKeelClient(address, key, options=options)

        try:
            self._client = self._loop.run(connect())
        except BaseException:
            self._loop.stop()
            raise
        self.address = address
        self.options = self._client.options
        self._closed = False
        self._closing = threading.Lock()

    def close(self) -> None:
        """Closes the connection; may be called from any thread, and wakes
        calls and iterators waiting on the client with `ClientClosed`."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        try:
            self._loop.run(self._client.close())
        finally:
            self._loop.stop()

    def create_session(self, session_id: str | None = None) -> str:
        return self._loop.run(self._client.create_session(session_id))

    def get_session(self, session_id: str) -> Session:
        return self._loop.run(self._client.get_session(session_id))

    def list_sessions(self, page_size: int = 0, page_token: str = "") -> SessionPage:
        return self._loop.run(self._client.list_sessions(page_size, page_token))

    def iter_sessions(self, page_size: int = 0) -> SyncIterator[SessionSummary]:
        return SyncIterator(self._loop, self._client.iter_sessions(page_size))

    def send_input(
        self,
        session_id: str,
        text: str,
        request_id: str | None = None,
        blob_ids: Sequence[str] = (),
        multitask: str | None = None,
    ) -> Input:
        return self._loop.run(
            self._client.send_input(session_id, text, request_id, blob_ids, multitask)
        )

    def cancel(self, session_id: str) -> Cancellation:
        return self._loop.run(self._client.cancel(session_id))

    def fork_session(self, session_id: str, at_seq: int, new_session_id: str = "") -> str:
        return self._loop.run(self._client.fork_session(session_id, at_seq, new_session_id))

    def edit_input(
        self, session_id: str, seq: int, text: str, request_id: str | None = None
    ) -> tuple[str, Input]:
        return self._loop.run(self._client.edit_input(session_id, seq, text, request_id))

    def create_schedule(
        self,
        session_id: str,
        text: str,
        *,
        cron: str = "",
        timezone: str = "UTC",
        at_ms: int = 0,
    ) -> Schedule:
        return self._loop.run(
            self._client.create_schedule(
                session_id, text, cron=cron, timezone=timezone, at_ms=at_ms
            )
        )

    def list_schedules(self, session_id: str) -> list[Schedule]:
        return self._loop.run(self._client.list_schedules(session_id))

    def delete_schedule(self, session_id: str, schedule_id: str) -> None:
        self._loop.run(self._client.delete_schedule(session_id, schedule_id))

    def skip_inputs(self, session_id: str) -> Skip:
        return self._loop.run(self._client.skip_inputs(session_id))

    def retry(self, session_id: str, seq: int, request_id: str | None = None) -> Input:
        return self._loop.run(self._client.retry(session_id, seq, request_id))

    def decide_approval(
        self, session_id: str, tool_call_id: str, approve: bool, note: str | None = None
    ) -> Decision:
        return self._loop.run(self._client.decide_approval(session_id, tool_call_id, approve, note))

    def events(self, session_id: str, after: int = 0) -> SyncIterator[Event]:
        """As `AsyncKeelClient.events`; `close()` it (or use `with`) when done."""
        return SyncIterator(self._loop, self._client.events(session_id, after))

    def get_context(self, session_id: str, at_seq: int = 0) -> Context:
        return self._loop.run(self._client.get_context(session_id, at_seq))

    def get_loadout(self) -> Loadout:
        return self._loop.run(self._client.get_loadout())

    def put_loadout(self, document: Mapping[str, Any], expected_revision: int = 0) -> int:
        return self._loop.run(self._client.put_loadout(document, expected_revision))
