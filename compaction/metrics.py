"""The compaction service's OpenTelemetry instruments (meter `keel.compaction`)."""

from __future__ import annotations

import time

from opentelemetry import metrics

from services.common.metrics_at_start import HistogramSpec, show_from_start

_METER = "keel.compaction"
_meter = metrics.get_meter(_METER)
_compactions = _meter.create_counter(
    "keel.compaction.compactions",
    description="compaction facts committed, by reason (threshold, overflow, manual)",
)
_DURATION = HistogramSpec(
    "keel.compaction.duration",
    unit="ms",
    description="a committed compaction from the Compact call to its fact in the ledger "
    "(reading the session, the summary model call, the append), by reason",
)
_duration = _DURATION.create(_meter)
_tokens = _meter.create_counter(
    "keel.compaction.tokens",
    description="context tokens before and after the compactions committed (when: before, after)",
)

_context_latency = _meter.create_histogram(
    "keel.compaction.context_latency",
    unit="ms",
    description="GetContext: a session's model context rebuilt from the ledger at a seq "
    "(what the edge's /context shows)",
)


REASONS = ("threshold", "overflow", "manual")


def prime() -> None:
    """Counters at 0 from the start (see kernel.metrics.prime), and the
    duration histogram served with a zero count until the first compaction."""
    show_from_start(_METER, _DURATION, [{"reason": reason} for reason in REASONS])
    for reason in REASONS:
        _compactions.add(0, {"reason": reason})


def context_built(started: float) -> None:
    _context_latency.record((time.perf_counter() - started) * 1000)


def compacted(reason: str, started: float, tokens_before: int, tokens_after: int) -> None:
    """One compaction committed; `started` is the call's `time.perf_counter()`."""
    attributes = {"reason": reason}
    _compactions.add(1, attributes)
    _duration.record((time.perf_counter() - started) * 1000, attributes)
    _tokens.add(tokens_before, {"when": "before"})
    _tokens.add(tokens_after, {"when": "after"})
