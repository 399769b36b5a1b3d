"""The kernel's OpenTelemetry instruments (meter `keel.kernel`).

Counters and histograms are recorded only after the transaction that made
the change committed, so a redone transaction never counts twice. The same
numbers are kept as plain totals on the object, for `keel status`, tests
and benchmarks that need to know which path was taken (e.g. that a lease
ended by disconnect, not by TTL).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from opentelemetry import metrics

from kernel.domain import Event, Transition

_meter = metrics.get_meter("keel.kernel")
_claims = _meter.create_counter("keel.kernel.claims", description="leases issued")
_reclaims = _meter.create_counter(
    "keel.kernel.reclaims", description="claims of a session whose previous lease expired"
)
_releases = _meter.create_counter("keel.kernel.releases", description="leases handed back")
_expirations = _meter.create_counter(
    "keel.kernel.expirations", description="leases expired, by cause (ttl, disconnect)"
)
_finishes = _meter.create_counter(
    "keel.kernel.finishes", description="attempts settled, by outcome (done, failed, parked)"
)
_lease_age = _meter.create_histogram(
    "keel.kernel.lease_age", unit="ms", description="how long a lease was held when it ended"
)
_queue_wait = _meter.create_histogram(
    "keel.kernel.queue_wait", unit="ms", description="runnable until claimed"
)

_ENDINGS = {
    Event.RELEASE: ("release", {}),
    Event.FINISH_DONE: ("finish", {"outcome": "done"}),
    Event.FINISH_FAILED: ("finish", {"outcome": "failed"}),
    Event.FINISH_PARKED: ("finish", {"outcome": "parked"}),
    Event.EXPIRE_TTL: ("expire", {"by": "ttl"}),
    Event.EXPIRE_DISCONNECT: ("expire", {"by": "disconnect"}),
}


class KernelMetrics:
    """Records committed transitions to OpenTelemetry and to local totals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Counter[str] = Counter()

    def record(self, transitions: Iterable[Transition]) -> None:
        for transition in transitions:
            self._record_one(transition)

    def _record_one(self, transition: Transition) -> None:
        event = transition.event
        names: list[str] = []
        if event is Event.CLAIM:
            _claims.add(1)
            _queue_wait.record(transition.duration_ms)
            names.append("claims")
            if transition.reclaimed:
                _reclaims.add(1)
                names.append("reclaims")
        elif event in _ENDINGS:
            kind, attributes = _ENDINGS[event]
            _lease_age.record(transition.duration_ms, {"ended_by": event.value})
            if kind == "release":
                _releases.add(1)
                names.append("releases")
            elif kind == "finish":
                _finishes.add(1, attributes)
                names.append(f"finishes_{attributes['outcome']}")
            else:
                _expirations.add(1, attributes)
                names.append(f"expirations_{attributes['by']}")
        if names:
            with self._lock:
                self._totals.update(names)

    def totals(self) -> dict[str, int]:
        """claims, reclaims, releases, expirations_ttl/_disconnect, finishes_*."""
        with self._lock:
            return dict(self._totals)
