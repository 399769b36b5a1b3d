"""The one way tests wait for something to become true: poll with a deadline.

A probe is called every `INTERVAL_S` until it gives a result: a value other
than None (returned to the caller) or True. None and False mean "not yet".
At the deadline the wait fails naming what it waited for and the probe's
last answer, so a timeout says what was seen rather than only that it hung.

`eventually` is for async tests and takes an async or a plain probe;
`eventually_sync` is its twin for code that runs outside an event loop
(threads, subprocess drivers). Neither sleeps longer than one interval, so a
test waits only as long as the system under test needs.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")

# Generous on purpose: a passing test never waits for it, and a loaded CI
# machine (real OS processes, SIGKILLs, PostgreSQL) must not fail by timing.
DEADLINE_S = 60.0
# Short, so a condition that holds is noticed within a few tens of ms.
INTERVAL_S = 0.05


def _failure(
    what: str, deadline_s: float, last: object, detail: Callable[[], object] | None
) -> str:
    message = f"timed out after {deadline_s:g}s waiting for {what}; last seen: {last!r}"
    if detail is not None:
        message += f"\n{detail()}"
    return message


@overload
async def eventually(
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    deadline_s: float = DEADLINE_S,
    *,
    detail: Callable[[], object] | None = None,
) -> T: ...


@overload
async def eventually(
    probe: Callable[[], T | None],
    what: str,
    deadline_s: float = DEADLINE_S,
    *,
    detail: Callable[[], object] | None = None,
) -> T: ...


async def eventually(
    probe: Callable[[], object],
    what: str,
    deadline_s: float = DEADLINE_S,
    *,
    detail: Callable[[], object] | None = None,
) -> object:
    """Polls `probe` until it returns a value (not None, not False); returns it.

    `detail`, when given, is called only on failure and its result added to
    the message (e.g. the events or lock waits the test saw).
    """
    deadline = time.monotonic() + deadline_s
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_failure(what, deadline_s, value, detail))
        await asyncio.sleep(INTERVAL_S)


def eventually_sync(
    probe: Callable[[], T | None],
    what: str,
    deadline_s: float = DEADLINE_S,
    *,
    detail: Callable[[], object] | None = None,
) -> T:
    """`eventually` for code without an event loop: blocks between polls."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(_failure(what, deadline_s, value, detail))
        time.sleep(INTERVAL_S)
