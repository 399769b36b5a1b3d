"""`keel bench turns`: input committed -> final answer committed, through the runner.

N sessions (50 by default) each run sequential turns against the instant
scripted model on PostgreSQL; latency is measured from the input's commit (the Append returning)
to the moment the session's final answer is visible in the ledger stream.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from bench.cluster import start
from kernel import KernelClient
from services.ledger import LedgerClient


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


async def _run(database_url: str | None, sessions: int, turns: int) -> dict[str, Any]:
    cluster = await start(database_url, with_edge=False, concurrency=sessions)
    latencies: list[float] = []
    try:
        async with (
            LedgerClient(cluster.ledger.target) as ledger,
            KernelClient(cluster.kernel.target) as kernel,
        ):

            async def session(n: int) -> None:
                session_id = f"turns-{n}"
                await ledger.create_session(session_id, "default")
                stream = ledger.subscribe(session_id, 0)
                for turn in range(turns):
                    appended = await ledger.append_one(
                        session_id, "input", {"text": f"turn {turn}", "requestId": f"r{turn}"}
                    )
                    committed = time.perf_counter()
                    await kernel.enqueue(session_id, "default", appended.seq)
                    async for fact in stream:
                        if fact.kind == "assistant" and appended.seq in (
                            fact.data.get("inputSeqs") or ()
                        ):
                            latencies.append((time.perf_counter() - committed) * 1000)
                            break

            # Warm-up: connections, prepared statements, the provider.
            await session(-1)
            latencies.clear()
            started = time.perf_counter()
            await asyncio.gather(*(session(n) for n in range(sessions)))
            elapsed = time.perf_counter() - started
    finally:
        await cluster.stop()
    return {
        "benchmark": "turns",
        "sessions": sessions,
        "turns_per_session": turns,
        "turns_per_s": round(len(latencies) / elapsed, 1),
        "latency_p50_ms": round(statistics.median(latencies), 2),
        "latency_p99_ms": round(percentile(latencies, 0.99), 2),
    }


def measure(database_url: str | None = None, sessions: int = 50, turns: int = 10) -> dict[str, Any]:
    return asyncio.run(_run(database_url, sessions, turns))
