"""An edge's server-sent event stream read as a browser's EventSource would."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from services.cli.chat_view import SseEvent, SseParser
from tests.support.edge_stack import DEADLINE_S


def parse(event: SseEvent) -> Any:
    return json.loads(event.data)


class SseReader:
    """One open event stream: yields parsed events; `close()` cuts it."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        session_id: str,
        last_event_id: str | None = None,
        after: int | None = None,
        key: str | None = None,
    ) -> None:
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        params = {"after": str(after)} if after is not None else {}
        self._context = http.stream(
            "GET", f"/v1/sessions/{session_id}/events", headers=headers, params=params
        )
        self.response: httpx.Response | None = None
        self._lines: AsyncIterator[str] | None = None
        self._parser = SseParser()

    async def __aenter__(self) -> SseReader:
        self.response = await self._context.__aenter__()
        assert self.response.status_code == 200, (await self.response.aread()).decode()
        assert self.response.headers["content-type"].startswith("text/event-stream")
        self._lines = self.response.aiter_lines()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._context.__aexit__(None, None, None)

    async def next(self, deadline_s: float = DEADLINE_S) -> SseEvent | None:
        """The next event, or None when the server ended the stream."""
        assert self._lines is not None

        async def one() -> SseEvent | None:
            assert self._lines is not None
            async for line in self._lines:
                event = self._parser.feed(line)
                if event is not None:
                    return event
            return None

        return await asyncio.wait_for(one(), deadline_s)

    async def until(
        self, predicate: Any, deadline_s: float = DEADLINE_S, into: list[SseEvent] | None = None
    ) -> SseEvent:
        """Reads until an event matches `predicate` (every event read goes to `into`)."""
        # Reads events as they arrive rather than polling (tests.support.polling):
        # a matching event may be followed by others, and each one read is spent.
        deadline = time.monotonic() + deadline_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError("no matching SSE event before the deadline")
            try:
                event = await self.next(remaining)
            except TimeoutError:
                raise AssertionError("no matching SSE event before the deadline") from None
            if event is None:
                raise AssertionError("the server ended the stream before a matching event")
            if into is not None:
                into.append(event)
            if predicate(event):
                return event


def fact_seqs(events: list[SseEvent]) -> list[int]:
    return [int(e.id) for e in events if e.id is not None]
