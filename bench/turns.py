"""`keel bench turns`: input committed -> final answer committed, through the runner.

N sessions (50 by default) each run sequential turns against the instant
scripted model on PostgreSQL; latency is measured from the input's commit (the Append returning)
to the moment the session's final answer is visible in the ledger stream.

Besides turns/s and latency it reports what a turn costs, over the measured
part only (after a warm-up session, until the runner is idle again):
`cpu_ms_per_turn` is the process's CPU time per turn — every service runs in
this one process (bench/cluster.py), so it is the whole turn's CPU: ledger,
kernel, runner and this client; `calls_per_turn` and `commits_per_turn` are
the RPCs the servers received and the write transactions the stores
committed (services/common/hops.py), with `calls_by_method` and
`commits_by_store` per turn. They include what runs on a timer meanwhile
(heartbeats, renewals, the reconciler); tests/test_turn_hops.py counts one
turn exactly, without those.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from bench.cluster import BenchCluster, start
from kernel import KernelClient
from services.common import event_loop, hops
from services.ledger import LedgerClient
from services.ledger.packed_facts import pack_input

# How long the runner may take to finish the attempts of the last turns.
SETTLE_S = 10.0
# Entered around the measured part only (bench/profile.py attaches a profiler).
Window = Callable[[], AbstractContextManager[None]]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


async def settle(cluster: BenchCluster) -> None:
    """Waits until no attempt runs: the last answer is seen before its
    attempt's Finish, which belongs to the turn all the same."""
    runtime = cluster.runner.runtime
    deadline = time.monotonic() + SETTLE_S
    # Polled: the runtime has no public event for it, and a ms is nothing here.
    while runtime is not None and runtime.in_flight and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.001)


def per_turn(counts: dict[str, int], turns: int) -> dict[str, float]:
    return {name: round(n / turns, 2) for name, n in sorted(counts.items())}


def cost_figures(spent: hops.Hops, cpu_s: float, turns: int) -> dict[str, Any]:
    """The per-turn cost fields of the result."""
    return {
        "cpu_s": round(cpu_s, 3),
        "cpu_ms_per_turn": round(cpu_s * 1000 / turns, 2),
        "calls_per_turn": round(spent.total_calls / turns, 2),
        "commits_per_turn": round(spent.total_commits / turns, 2),
        "calls_by_method": per_turn(spent.calls, turns),
        "commits_by_store": per_turn(spent.commits, turns),
    }


async def _run(
    database_url: str | None, sessions: int, turns: int, window: Window
) -> dict[str, Any]:
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
                    data = {"text": f"turn {turn}", "requestId": f"r{turn}"}
                    appended = await ledger.append_one(session_id, "input", data)
                    committed = time.perf_counter()
                    # As the edge does: the input goes with the wake-up.
                    facts = pack_input(session_id, appended.seq, data)
                    await kernel.enqueue(session_id, "default", appended.seq, facts=facts)
                    async for fact in stream:
                        if fact.kind == "assistant" and appended.seq in (
                            fact.data.get("inputSeqs") or ()
                        ):
                            latencies.append((time.perf_counter() - committed) * 1000)
                            break

            # Warm-up: connections, prepared statements, the provider.
            await session(-1)
            await settle(cluster)
            latencies.clear()
            with window():
                before = hops.snapshot()
                cpu_before = time.process_time()
                started = time.perf_counter()
                await asyncio.gather(*(session(n) for n in range(sessions)))
                elapsed = time.perf_counter() - started
                await settle(cluster)
                cpu_s = time.process_time() - cpu_before
                spent = hops.snapshot().since(before)
    finally:
        await cluster.stop()
    return {
        "benchmark": "turns",
        "sessions": sessions,
        "turns_per_session": turns,
        "turns_per_s": round(len(latencies) / elapsed, 1),
        "latency_p50_ms": round(statistics.median(latencies), 2),
        "latency_p99_ms": round(percentile(latencies, 0.99), 2),
        **cost_figures(spent, cpu_s, len(latencies)),
    }


def measure(
    database_url: str | None = None,
    sessions: int = 50,
    turns: int = 10,
    window: Window = contextlib.nullcontext,
) -> dict[str, Any]:
    return event_loop.run(_run(database_url, sessions, turns, window), runs_attempts=True)
