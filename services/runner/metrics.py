"""The runner's OpenTelemetry instruments (meter `keel.runner`).

Recorded where the runner learns the fact: a turn when its final answer is
committed, an attempt's outcome when it ends, a takeover's first commit when
a reclaimed lease's `epoch_started` is in the ledger, a drain when it has
finished, a tool call and a model call when they return.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import metrics

from agent_io.providers.base import Usage
from kernel.domain import DrainMode
from services.common.metrics_at_start import HistogramSpec, show_from_start

_METER = "keel.runner"
_meter = metrics.get_meter(_METER)
_turns = _meter.create_counter(
    "keel.runner.turns", description="final answers committed (each answers owed inputs)"
)
_attempts = _meter.create_counter(
    "keel.runner.attempts",
    description="attempts ended, by outcome: done, failed, lost (the lease "
    "expired under it), fenced (a newer epoch wrote), handoff (stopped at a boundary by a "
    "drain), stopped (cancelled by a shutdown), not_started",
)
_TAKEOVER_FIRST_COMMIT = HistogramSpec(
    "keel.runner.takeover_first_commit",
    unit="ms",
    description="a successor's part of a takeover: from receiving a reclaimed lease "
    "(its holder died) to its first commit, the epoch_started fact; the time before the "
    "claim is keel.kernel.takeover_latency",
)
_takeover_first_commit = _TAKEOVER_FIRST_COMMIT.create(_meter)
_DRAIN_DURATION = HistogramSpec(
    "keel.runner.drain_duration",
    unit="ms",
    description="a drain from its request to its end (attempts settled or stopped), by mode",
)
_drain_duration = _DRAIN_DURATION.create(_meter)
_tool_latency = _meter.create_histogram(
    "keel.runner.tool_latency",
    unit="ms",
    description="one tool call, by source (builtin, or the loadout's source name) and "
    "outcome (ok, error)",
)
_provider_latency = _meter.create_histogram(
    "keel.runner.provider_latency",
    unit="ms",
    description="one model call, from the request to its completed answer (or failure), "
    "by provider and outcome",
)
_provider_first_event = _meter.create_histogram(
    "keel.runner.provider_first_event",
    unit="ms",
    description="one model call, from the request to the first streamed event, by provider",
)
_provider_tokens = _meter.create_counter(
    "keel.runner.provider_tokens",
    description="tokens the model reported, by provider and kind (input, output, "
    "cache_read, cache_write)",
)

_claim_failures = _meter.create_counter(
    "keel.runner.claim_failures",
    description="claims that failed, by why: unavailable (the kernel or its database is "
    "away; logged once per outage), refused (the kernel said no), error (a bug, logged with "
    "its traceback)",
)

BUILTIN_SOURCE = "builtin"
DRAIN_MODES = (DrainMode.HANDOFF, DrainMode.SHUTDOWN)
CLAIM_FAILURES = ("unavailable", "refused", "error")


ATTEMPT_OUTCOMES = (
    "done",
    "failed",
    "lost",
    "fenced",
    "handoff",
    "stopped",
    "not_started",
)


def prime() -> None:
    """Counters at 0 from the start (see kernel.metrics.prime), and the
    histograms of rare events served with a zero count until the first."""
    show_from_start(_METER, _TAKEOVER_FIRST_COMMIT)
    show_from_start(_METER, _DRAIN_DURATION, [{"mode": mode.value} for mode in DRAIN_MODES])
    _turns.add(0)
    for outcome in ATTEMPT_OUTCOMES:
        _attempts.add(0, {"outcome": outcome})
    for why in CLAIM_FAILURES:
        _claim_failures.add(0, {"why": why})


def claim_failed(why: str) -> None:
    """One claim failed: `why` is one of CLAIM_FAILURES."""
    _claim_failures.add(1, {"why": why})


def turn_answered() -> None:
    _turns.add(1)


def attempt_ended(outcome: str) -> None:
    _attempts.add(1, {"outcome": outcome})


def takeover_first_commit(elapsed_ms: float) -> None:
    _takeover_first_commit.record(elapsed_ms)


def drain_finished(mode: str, elapsed_ms: float) -> None:
    _drain_duration.record(elapsed_ms, {"mode": mode})


def tool_source(name: str) -> str:
    """The source of a tool as the model names it: a source's tools carry
    its name as a prefix (`files.read`), built-ins none."""
    prefix, dot, _ = name.partition(".")
    return prefix if dot else BUILTIN_SOURCE


def tool_called(name: str, elapsed_ms: float, is_error: bool) -> None:
    _tool_latency.record(
        elapsed_ms, {"source": tool_source(name), "outcome": "error" if is_error else "ok"}
    )


class ProviderCall:
    """Times the model calls of one attempt, one at a time: `timing()` around
    a call, `first_event()` when its stream yields first, `completed()` with
    the answer's usage."""

    def __init__(self) -> None:
        self._provider = ""
        self._started = 0.0
        self._outcome = "error"
        self._first_seen = True

    @contextmanager
    def timing(self, provider: str) -> Iterator[ProviderCall]:
        self._provider, self._started = provider, time.perf_counter()
        self._outcome, self._first_seen = "error", False
        try:
            yield self
        except BaseException as error:
            # A lost lease or a drain cancels the call: not the model's failure.
            if not isinstance(error, Exception):
                self._outcome = "cancelled"
            raise
        finally:
            _provider_latency.record(
                self._elapsed_ms(), {"provider": provider, "outcome": self._outcome}
            )

    def first_event(self) -> None:
        if not self._first_seen and self._provider:
            self._first_seen = True
            _provider_first_event.record(self._elapsed_ms(), {"provider": self._provider})

    def completed(self, usage: Usage) -> None:
        self._outcome = "ok"
        for kind, count in (
            ("input", usage.input),
            ("output", usage.output),
            ("cache_read", usage.cache_read),
            ("cache_write", usage.cache_write),
        ):
            if count:
                _provider_tokens.add(count, {"provider": self._provider, "kind": kind})

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self._started) * 1000
