"""Wakes long-polling claims when work may have become claimable.

A waiting claim takes the current event *before* it asks the store, then
waits on it; any change committed after that point sets the event, so a
wake-up between "found nothing" and "wait" is never lost. `wake` is safe to
call from the store's worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib


class ClaimWaker:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event = asyncio.Event()
        self.wakes = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def current(self) -> asyncio.Event:
        return self._event

    def wake(self) -> None:
        """Thread-safe: schedules the wake-up on the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake()
        else:
            # The loop may close between the check above and this call.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.wakes += 1
        event, self._event = self._event, asyncio.Event()
        event.set()
