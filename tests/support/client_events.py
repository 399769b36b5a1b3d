"""Reading a client library event iterator in tests: up to a matching event,
within a deadline, keeping every event read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from keel_client import Event, Fact

DEADLINE_S = 30.0


async def read_until(
    events: AsyncIterator[Event],
    predicate: Callable[[Event], bool],
    into: list[Event],
    deadline_s: float = DEADLINE_S,
) -> Event:
    """Reads `events` into `into` until one matches; fails at the deadline."""

    async def read() -> Event:
        async for event in events:
            into.append(event)
            if predicate(event):
                return event
        raise AssertionError("the event iterator ended before a matching event")

    try:
        return await asyncio.wait_for(read(), deadline_s)
    except TimeoutError:
        facts = [(e.seq, e.kind) for e in into if isinstance(e, Fact)]
        raise AssertionError(
            f"no matching event within {deadline_s}s; facts read: {facts}; "
            f"last events read: {into[-3:]}"
        ) from None


def answers(input_seq: int) -> Callable[[Event], bool]:
    """Matches the final assistant fact answering the input at `input_seq`."""

    def match(event: Event) -> bool:
        return (
            isinstance(event, Fact)
            and event.kind == "assistant"
            and input_seq in event.data.get("inputSeqs", ())
        )

    return match


def has_seq(seq: int) -> Callable[[Event], bool]:
    return lambda event: isinstance(event, Fact) and event.seq == seq


def fact_seqs(events: list[Event]) -> list[int]:
    return [event.seq for event in events if isinstance(event, Fact)]
