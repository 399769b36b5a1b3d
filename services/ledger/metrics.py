"""The ledger's OpenTelemetry instruments (meter `keel.ledger`).

Append latency is what a caller of `Append` waits: queued behind the writer,
decided, committed in a batch, delivered. Batch sizes say how many appends
one database transaction carried.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import metrics

from services.ledger.errors import StaleEpoch

_meter = metrics.get_meter("keel.ledger")
_append_latency = _meter.create_histogram(
    "keel.ledger.append_latency",
    unit="ms",
    description="an Append call from its arrival to its outcome (committed, duplicate "
    "or refused), by outcome (ok, stale, error)",
)
_batch_size = _meter.create_histogram(
    "keel.ledger.batch_size",
    description="appends committed together in one database transaction by the writer",
    explicit_bucket_boundaries_advisory=[1, 2, 4, 8, 16, 32, 64, 128, 256],
)
_facts_appended = _meter.create_counter(
    "keel.ledger.facts_appended", description="facts committed (duplicates not counted)"
)


def prime() -> None:
    """Counters at 0 from the start (see kernel.metrics.prime)."""
    _facts_appended.add(0)


def time_append(started: float) -> Callable[[asyncio.Future[Any]], None]:
    """A done-callback of an append's outcome recording its latency from
    `started` (a `time.perf_counter()` reading)."""

    def settled(outcome: asyncio.Future[Any]) -> None:
        elapsed_ms = (time.perf_counter() - started) * 1000
        if outcome.cancelled():
            result = "error"
        else:
            error = outcome.exception()
            result = "ok" if error is None else "error"
            if isinstance(error, StaleEpoch):
                result = "stale"
            if error is None:
                fresh = sum(1 for appended in outcome.result() if not appended.duplicate)
                if fresh:
                    _facts_appended.add(fresh)
        _append_latency.record(elapsed_ms, {"outcome": result})

    return settled


def record_batch(appends: int) -> None:
    _batch_size.record(appends)
