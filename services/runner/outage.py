"""What an attempt does when Keel itself is away: its database, the ledger
or the kernel answering UNAVAILABLE mid-turn.

Nothing of the turn failed, so no failed attempt is counted (a few outages
would otherwise park a session). The attempt stops where it is and hands its
lease back as soon as the kernel answers again, so the session goes on at
once after the outage instead of after the lease's TTL. Whatever it may have
committed before it stopped is safe: the successor reads the ledger, and a
repeated answer or tool result deduplicates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.errors import KeelError, ServiceUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_RETRY_S = 0.1
MAX_RETRY_S = 2.0


async def once_answered(call: Callable[[], Awaitable[T]], within_s: float) -> T | None:
    """`call()`'s result, retried with backoff while it fails UNAVAILABLE,
    for at most `within_s` (the rest of the lease: after that the TTL frees
    the session anyway). None if the time ran out or the call was refused
    for good (the lease is lost: a successor has it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    delay = FIRST_RETRY_S
    while True:
        try:
            return await call()
        except ServiceUnavailable as error:
            if loop.time() + delay > deadline:
                # One per attempt an outage outlasted, and harmless (the TTL
                # frees the session): the outage itself is said once by the
                # runner's outage log, so this is not a warning too.
                log.info("gave up waiting for the kernel: %s", error)
                return None
        except KeelError as error:
            log.info("not settled: %s", error)
            return None
        await asyncio.sleep(delay)  # backoff while the service is away
        delay = min(delay * 2, MAX_RETRY_S)
