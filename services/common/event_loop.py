"""The event loop every Keel process serves on: uvloop.

Measured with `keel bench turns` and `keel bench e2e`: a turn costs 10-20%
less CPU on uvloop than on asyncio's own loop (a turn is mostly hops, and
a hop is mostly event-loop work), and the edge's broadcast to 1000 clients
is faster still. grpc.aio runs on it as on asyncio's loop.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` to its end on a new uvloop event loop, as `asyncio.run`
    does on asyncio's."""
    return uvloop.run(main)
