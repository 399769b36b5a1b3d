"""`keel bench timeline`: the wall-clock timeline of one turn, one session alone.

    keel bench timeline --turns 200

Runs `keel bench turns`' workload for one session and marks, with
perf_counter, the entry and exit of each step a turn goes through, on
whichever thread runs it: the client's append and wake-up, each servicer
method, each store call (on the stores' worker threads and the ledger's
writer), the runner's claim, reads, commits, model call and finish. Prints,
per step, the median offset from the start of the turn (the client's
Append) and the median time between the step and the one before it, so a
wait that is not CPU — a hand-off between threads, a long poll that wakes
late, a subscriber woken on a timer — shows as a gap where nothing of ours
runs.

The marks are put in by wrapping classes' methods in this process (before
the services start), so each adds a few µs; compare gaps, not totals, with
`keel bench turns`.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import threading
import time
from collections import Counter
from typing import Any

from bench.cluster import start
from bench.turns import settle
from kernel import KernelClient
from services.common import event_loop
from services.ledger import LedgerClient

# (module, class, methods): what a turn passes through, in the order it
# usually does. A method that does not exist (yet, or any more) is skipped.
STEPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("services.ledger.client", "LedgerClient", ("append_one", "read")),
    ("kernel.client", "KernelClient", ("enqueue", "claim", "get_loadout", "finish")),
    ("services.ledger.servicer", "LedgerServicer", ("Append", "Read")),
    ("services.ledger.store", "LedgerStore", ("submit_async", "_commit_batch", "_save", "read")),
    (
        "kernel.servicer",
        "KernelServicer",
        ("Enqueue", "Claim", "_claim_once", "GetLoadout", "Finish"),
    ),
    ("kernel.store", "LeaseStore", ("enqueue", "claim", "finish")),
    ("kernel.waker", "ClaimWaker", ("wake", "_wake")),
    ("services.runner.runtime", "Runtime", ("_run", "_attempt")),
    ("services.runner.factcache", "FactCache", ("load",)),
    ("services.runner.attempt", "Attempt", ("start", "commit", "answer", "stream")),
)


# The critical path of a turn as (label, from step, its occurrence in the
# turn, to step): each segment runs from that mark to the first `to` mark
# after it. Hand-offs between threads and RPC transits are segments of
# their own, so a wait shows up by name.
A, C = "LedgerClient.append_one", "KernelClient.claim"
SEGMENTS: tuple[tuple[str, str, int, str], ...] = (
    ("input: client -> Append handler", A + " >", 1, "LedgerServicer.Append >"),
    (
        "input: handler -> writer thread",
        "LedgerStore.submit_async <",
        1,
        "LedgerStore._commit_batch >",
    ),
    (
        "input: commit (decide + INSERT)",
        "LedgerStore._commit_batch >",
        1,
        "LedgerStore._commit_batch <",
    ),
    ("input: writer -> loop -> reply", "LedgerStore._commit_batch <", 1, "LedgerServicer.Append <"),
    ("input: reply -> client", "LedgerServicer.Append <", 1, A + " <"),
    ("enqueue: client -> handler", "KernelClient.enqueue >", 1, "KernelServicer.Enqueue >"),
    ("enqueue: handler -> worker thread", "KernelServicer.Enqueue >", 1, "LeaseStore.enqueue >"),
    ("enqueue: transaction", "LeaseStore.enqueue >", 1, "ClaimWaker.wake >"),
    ("wake: worker -> loop", "ClaimWaker.wake >", 1, "ClaimWaker._wake >"),
    ("wake: loop -> waiting claim runs", "ClaimWaker._wake <", 1, "KernelServicer._claim_once >"),
    ("claim: handler -> worker thread", "KernelServicer._claim_once >", 1, "LeaseStore.claim >"),
    ("claim: transaction", "LeaseStore.claim >", 1, "LeaseStore.claim <"),
    ("claim: worker -> loop", "LeaseStore.claim <", 1, "KernelServicer._claim_once <"),
    ("claim: reply -> runner", "KernelServicer.Claim <", 1, C + " <"),
    ("attempt: lease -> loadout + history", C + " <", 1, "Attempt.start >"),
    ("epoch_started: whole append", A + " >", 2, A + " <"),
    ("answer: context + model", A + " <", 2, A + " >"),
    ("answer: whole append", A + " >", 3, A + " <"),
    (
        "answer committed -> client sees it",
        "LedgerStore._commit_batch <",
        3,
        "client: answer seen >",
    ),
    ("finish: whole call", "KernelClient.finish >", 1, "KernelClient.finish <"),
)


class Marks:
    """Per turn, (step, thread, perf_counter) in the order they happened."""

    def __init__(self) -> None:
        self.turns: list[list[tuple[str, str, float]]] = []

    def mark(self, step: str) -> None:
        if self.turns:
            # list.append is atomic: worker threads mark as well.
            self.turns[-1].append((step, threading.current_thread().name, time.perf_counter()))


def _wrapped(marks: Marks, label: str, method: Any) -> Any:
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            marks.mark(label + " >")
            try:
                return await method(*args, **kwargs)
            finally:
                marks.mark(label + " <")

        return timed_async

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        marks.mark(label + " >")
        try:
            return method(*args, **kwargs)
        finally:
            marks.mark(label + " <")

    return timed


def instrument(marks: Marks) -> list[str]:
    """Wraps every step's method (for the rest of this process); returns them."""
    import importlib

    done = []
    for module_name, class_name, methods in STEPS:
        owner = getattr(importlib.import_module(module_name), class_name, None)
        for name in methods:
            method = None if owner is None else owner.__dict__.get(name)
            if method is None or inspect.isasyncgenfunction(method):
                continue
            setattr(owner, name, _wrapped(marks, f"{class_name}.{name}", method))
            done.append(f"{class_name}.{name}")
    return done


def _timeline(turns: list[list[tuple[str, str, float]]]) -> list[dict[str, Any]]:
    """The median turn: steps numbered by occurrence (`Append > #2`), each
    with its median offset from the turn's start and from the step before."""
    offsets: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    threads: dict[str, Counter[str]] = {}
    for marks in turns:
        if not marks:
            continue
        start = marks[0][2]
        seen: Counter[str] = Counter()
        previous = start
        for step, thread, at in marks:
            seen[step] += 1
            key = f"{step} #{seen[step]}"
            offsets.setdefault(key, []).append((at - start) * 1000)
            gaps.setdefault(key, []).append((at - previous) * 1000)
            threads.setdefault(key, Counter())[_pool(thread)] += 1
            previous = at
    rows = [
        {
            "step": key,
            "at_ms": round(statistics.median(values), 3),
            "after_previous_ms": round(statistics.median(gaps[key]), 3),
            "thread": threads[key].most_common(1)[0][0],
            "in_turns": len(values),
        }
        for key, values in offsets.items()
    ]
    return sorted(rows, key=lambda row: row["at_ms"])


def _segments(turns: list[list[tuple[str, str, float]]]) -> list[dict[str, Any]]:
    spans: dict[str, list[float]] = {}
    for marks in turns:
        for label, first, occurrence, end in SEGMENTS:
            seen = 0
            for index, (step, _, at) in enumerate(marks):
                if step != first:
                    continue
                seen += 1
                if seen < occurrence:
                    continue
                after = next((t for s, _, t in marks[index + 1 :] if s == end), None)
                if after is not None:
                    spans.setdefault(label, []).append((after - at) * 1000)
                break
    return [
        {
            "segment": label,
            "p50_ms": round(statistics.median(spans[label]), 3),
            "p90_ms": round(sorted(spans[label])[int(0.9 * (len(spans[label]) - 1))], 3),
            "in_turns": len(spans[label]),
        }
        for label, *_ in SEGMENTS
        if label in spans
    ]


def _pool(thread: str) -> str:
    return thread.rstrip("0123456789") + "N" if thread[-1:].isdigit() else thread


async def _run(database_url: str | None, turns: int) -> dict[str, Any]:
    marks = Marks()
    wrapped = instrument(marks)
    cluster = await start(database_url, with_edge=False, concurrency=1)
    latencies: list[float] = []
    try:
        async with (
            LedgerClient(cluster.ledger.target) as ledger,
            KernelClient(cluster.kernel.target) as kernel,
        ):
            session_id = "timeline-0"
            await ledger.create_session(session_id, "default")
            stream = ledger.subscribe(session_id, 0)
            for turn in range(turns + 1):
                await settle(cluster)
                # The first turn warms up (connections, the cache): not kept.
                if turn == 1:
                    marks.turns.clear()
                marks.turns.append([])
                started = time.perf_counter()
                appended = await ledger.append_one(
                    session_id, "input", {"text": f"turn {turn}", "requestId": f"r{turn}"}
                )
                await kernel.enqueue(session_id, "default", appended.seq)
                async for fact in stream:
                    if fact.kind == "assistant" and appended.seq in (
                        fact.data.get("inputSeqs") or ()
                    ):
                        marks.mark("client: answer seen >")
                        latencies.append((time.perf_counter() - started) * 1000)
                        break
            await settle(cluster)
    finally:
        await cluster.stop()
    return {
        "benchmark": "timeline",
        "turns": turns,
        "append_to_answer_p50_ms": round(statistics.median(latencies[1:]), 2),
        "instrumented": wrapped,
        "segments": _segments(marks.turns),
        "timeline": _timeline(marks.turns),
    }


def measure(database_url: str | None = None, turns: int = 200) -> dict[str, Any]:
    return event_loop.run(_run(database_url, turns), runs_attempts=True)


def render(result: dict[str, Any]) -> str:
    lines = [
        f"one session, {result['turns']} turns; client Append -> answer seen, "
        f"p50 {result['append_to_answer_p50_ms']} ms (instrumented)",
        f"{'p50 ms':>8} {'p90 ms':>8}  segment of the critical path",
    ]
    for row in result["segments"]:
        lines.append(f"{row['p50_ms']:8.3f} {row['p90_ms']:8.3f}  {row['segment']}")
    lines += ["", "every step, by median offset from the client's Append:"]
    lines += [
        f"{'at ms':>8} {'+ms':>7}  {'thread':<18} step",
    ]
    for row in result["timeline"]:
        lines.append(
            f"{row['at_ms']:8.3f} {row['after_previous_ms']:7.3f}  {row['thread']:<18} "
            f"{row['step']}"
            + ("" if row["in_turns"] >= result["turns"] else f" ({row['in_turns']})")
        )
    return "\n".join(lines)
