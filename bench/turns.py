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

`layout="split"` runs the ledger, the kernel and the runner each in a
process of its own (bench/split_cluster.py), as `keel up --processes` does;
its CPU per turn is every process's, and the counts are left out.
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
from bench.split_cluster import SplitCluster, start_split
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
    database_url: str | None, sessions: int, turns: int, window: Window, layout: str
) -> dict[str, Any]:
    cluster: BenchCluster | SplitCluster
    if layout == "split":
        cluster = await start_split(database_url, concurrency=sessions)
        targets = (cluster.ledger_target, cluster.kernel_target)
    else:
        cluster = await start(database_url, with_edge=False, concurrency=sessions)
        targets = (cluster.ledger.target, cluster.kernel.target)
    latencies: list[float] = []
    names = [f"turns-{n}" for n in range(sessions)]

    async def settled() -> None:
        if isinstance(cluster, SplitCluster):
            await cluster.settle(names)
        else:
            await settle(cluster)

    def cpu_readings() -> dict[str, float]:
        """CPU seconds so far: this process's (the client, and in one
        process every service), and each service process's when split."""
        readings = {"client": time.process_time()}
        if isinstance(cluster, SplitCluster):
            readings.update(cluster.cpu_by_process())
        return readings

    try:
        async with (
            LedgerClient(targets[0], cluster.settings) as ledger,
            KernelClient(targets[1], cluster.settings) as kernel,
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
            await settled()
            latencies.clear()
            with window():
                before = hops.snapshot()
                cpu_before = cpu_readings()
                started = time.perf_counter()
                await asyncio.gather(*(session(n) for n in range(sessions)))
                elapsed = time.perf_counter() - started
                await settled()
                by_process = {k: v - cpu_before[k] for k, v in cpu_readings().items()}
                cpu_s = sum(by_process.values())
                spent = hops.snapshot().since(before)
    finally:
        await cluster.stop()
    costs = cost_figures(spent, cpu_s, len(latencies))
    if layout == "split":
        # Counted in the service processes, not here.
        costs = {k: v for k, v in costs.items() if k in ("cpu_s", "cpu_ms_per_turn")}
        # Each process's CPU per turn (the client plays the edge's part).
        costs["cpu_ms_per_turn_by_process"] = {
            name: round(spent_s * 1000 / len(latencies), 2) for name, spent_s in by_process.items()
        }
    return {
        "benchmark": "turns",
        "layout": layout,
        "sessions": sessions,
        "turns_per_session": turns,
        "turns_per_s": round(len(latencies) / elapsed, 1),
        "latency_p50_ms": round(statistics.median(latencies), 2),
        "latency_p99_ms": round(percentile(latencies, 0.99), 2),
        **costs,
    }


def measure(
    database_url: str | None = None,
    sessions: int = 50,
    turns: int = 10,
    window: Window = contextlib.nullcontext,
    layout: str = "one",
) -> dict[str, Any]:
    if layout not in ("one", "split"):
        raise ValueError(f"layout must be 'one' or 'split', got {layout!r}")
    return event_loop.run(_run(database_url, sessions, turns, window, layout), runs_attempts=True)
