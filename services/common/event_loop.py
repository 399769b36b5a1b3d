"""The event loop a Keel process serves on.

uvloop where it was measured to pay and nothing depends on asyncio's own
loop: `keel bench ledger` and `keel bench e2e` spend 10-20% less CPU per
append and per broadcast on it, and grpc.aio runs on it as on asyncio's
loop. A process that runs attempts (a runner, or `keel up` with its
embedded runner) stays on asyncio's loop: MCP tool servers are its stdio
children, and under uvloop their pipes were intermittently closed at start
(2 of 10 runs of tests/runner/test_tool_sessions.py), which asyncio's loop
never did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, runs_attempts: bool = False) -> T:
    """Runs `main` to its end on a new event loop: uvloop's, or asyncio's
    for a process that runs attempts (and so their stdio tool servers)."""
    if runs_attempts:
        return asyncio.run(main)
    return uvloop.run(main)
