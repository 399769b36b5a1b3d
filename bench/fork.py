"""`keel bench fork`: what forking a long session costs, copy against read.

A fork holds its own copy of the parent's rows (edge/forks.py), copied by
PostgreSQL in the fork's one statement. The alternative design, a reference
(parent + seq) resolved on read, costs nothing at fork time but adds the
parent's prefix to every read, fold and rebuild of the fork, for as long as
it lives. So the two figures that decide it are printed side by side:
`fork_ms`, one fork of a `facts`-fact session through the ledger's gRPC
API, and `read_ms`, one read of those same facts, which a reference-based
fork would pay on each cold start of it (`keel bench rebuild` measures a
whole rebuild). p50 and min over `runs`.

Run: `keel bench fork` or `python -m bench.fork [DATABASE_URL]`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from typing import Any

from bench.ledger import standalone_ledger
from services.common.config import Settings
from services.ledger import FactToAppend, LedgerClient

DEFAULT_FACTS = 10_000
APPEND_BATCH = 250


def _input(n: int) -> FactToAppend:
    return FactToAppend("input", {"text": f"message {n} " * 10, "requestId": f"r{n}"})


async def _measure(target: str, settings: Settings, facts: int, runs: int) -> dict[str, Any]:
    async with LedgerClient(target, settings) as ledger:
        parent = f"parent-{uuid.uuid4().hex[:8]}"
        await ledger.create_session(parent, "bench")
        written = 1
        while written < facts:
            count = min(APPEND_BATCH, facts - written)
            await ledger.append(parent, [_input(written + i) for i in range(count)])
            written += count
        fork_ms: list[float] = []
        read_ms: list[float] = []
        for _ in range(runs):
            started = time.perf_counter()
            await ledger.fork_session(parent, f"fork-{uuid.uuid4().hex[:8]}", facts)
            fork_ms.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            await ledger.read_all(parent)
            read_ms.append((time.perf_counter() - started) * 1000)
    return {
        "benchmark": "fork",
        "facts": facts,
        "runs": runs,
        "fork_ms_p50": round(statistics.median(fork_ms), 1),
        "fork_ms_min": round(min(fork_ms), 1),
        "read_ms_p50": round(statistics.median(read_ms), 1),
        "read_ms_min": round(min(read_ms), 1),
    }


def measure(database_url: str | None, facts: int = DEFAULT_FACTS, runs: int = 5) -> dict[str, Any]:
    """The ledger as its own OS process on PostgreSQL, as deployed."""
    with standalone_ledger(database_url) as ledger:
        return asyncio.run(_measure(ledger.target, ledger.client_settings, facts, runs))


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else None)))
