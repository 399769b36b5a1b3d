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

from services.common.metrics_at_start import HistogramSpec, show_from_start
from services.ledger.errors import StaleEpoch

_METER = "keel.ledger"
_meter = metrics.get_meter(_METER)
_APPEND_LATENCY = HistogramSpec(
    "keel.ledger.append_latency",
    unit="ms",
    description="an Append call from its arrival to its outcome (committed, duplicate "
    "or refused), by outcome (ok, stale, error)",
)
_append_latency = _APPEND_LATENCY.create(_meter)
_BATCH_SIZE = HistogramSpec(
    "keel.ledger.batch_size",
    unit="",
    description="appends committed together in one database transaction by the writer",
    boundaries=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
_batch_size = _BATCH_SIZE.create(_meter)
_facts_appended = _meter.create_counter(
    "keel.ledger.facts_appended", description="facts committed (duplicates not counted)"
)
_stale_appends = _meter.create_counter(
    "keel.ledger.stale_appends",
    description="appends refused by the fence (STALE_EPOCH): a writer whose lease was "
    "taken over, stopped before it wrote a conflicting fact",
)

_turns_settled = _meter.create_counter(
    "keel.ledger.turns_settled",
    description="attempts whose Finish (done, session kept) the ledger did in the "
    "transaction of their final answer; the kernel's keel.kernel.finishes does not "
    "count these",
)


def prime() -> None:
    """Counters at 0 from the start (see kernel.metrics.prime); histograms
    served with a zero count until the first append
    (services.common.metrics_at_start)."""
    show_from_start(_METER, _APPEND_LATENCY, [{"outcome": "ok"}])
    show_from_start(_METER, _BATCH_SIZE)
    _facts_appended.add(0)
    _stale_appends.add(0)
    _turns_settled.add(0)


def turns_settled(count: int) -> None:
    """Finishes done by the writer's transaction (services.ledger.group_commit)."""
    _turns_settled.add(count)


def stale_append_refused() -> None:
    """The fence refused an append (services.ledger.servicer.note_refusal)."""
    _stale_appends.add(1)


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
