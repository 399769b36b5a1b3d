"""The kernel's OpenTelemetry instruments (meter `keel.kernel`).

Counters and histograms are recorded only after the transaction that made
the change committed, so a redone transaction never counts twice. The same
numbers are kept as plain totals on the object, for `keel status`, tests
and benchmarks that need to know which path was taken (e.g. that a lease
ended by disconnect, not by TTL).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from kernel.domain import Event, Transition
from services.common.metrics_at_start import HistogramSpec, show_from_start

log = logging.getLogger(__name__)
_METER = "keel.kernel"
_meter = metrics.get_meter(_METER)
_claims = _meter.create_counter("keel.kernel.claims", description="leases issued (epochs)")
_reclaims = _meter.create_counter(
    "keel.kernel.reclaimed",
    description="claims that took over a lease its holder never gave back (it expired by "
    "TTL or its holder's connection died): the claim answered reclaimed=true, "
    "by how the old lease ended (expired_by: ttl, disconnect)",
)
_TAKEOVER = HistogramSpec(
    "keel.kernel.takeover_latency",
    unit="ms",
    description="a reclaimed claim's takeover time: from the moment the old lease was "
    "lost (its TTL deadline, or its holder's disconnect) to the successor's claim, "
    "by expired_by; the successor's first commit after the claim is "
    "keel.runner.takeover_first_commit",
)
_takeover = _TAKEOVER.create(_meter)
_admission_rejections = _meter.create_counter(
    "keel.kernel.admission_rejections",
    description="claimable sessions passed over by a claim because their tenant had no "
    "free run slot (max concurrent runs)",
)
_releases = _meter.create_counter("keel.kernel.releases", description="leases handed back")
_wakes = _meter.create_counter(
    "keel.kernel.wakes",
    description="inputs sent straight to the runner keeping their session in a sticky "
    "window: the lease held again (or held on, when the input came before the runner's "
    "Finish) with the same epoch, no claim",
)
_expirations = _meter.create_counter(
    "keel.kernel.expirations", description="leases expired, by cause (ttl, disconnect)"
)
_finishes = _meter.create_counter(
    "keel.kernel.finishes", description="attempts settled, by outcome (done, failed, parked)"
)
_lease_age = _meter.create_histogram(
    "keel.kernel.lease_age", unit="ms", description="how long a lease was held when it ended"
)
_QUEUE_WAIT = HistogramSpec(
    "keel.kernel.queue_wait", unit="ms", description="runnable until claimed"
)
_queue_wait = _QUEUE_WAIT.create(_meter)

_ENDINGS = {
    Event.RELEASE: ("release", {}),
    Event.FINISH_DONE: ("finish", {"outcome": "done"}),
    Event.FINISH_FAILED: ("finish", {"outcome": "failed"}),
    Event.FINISH_PARKED: ("finish", {"outcome": "parked"}),
    Event.EXPIRE_TTL: ("expire", {"by": "ttl"}),
    Event.EXPIRE_DISCONNECT: ("expire", {"by": "disconnect"}),
}


def prime() -> None:
    """Counters at 0 from the start, so a scrape shows them (and a rate over
    them starts) before the first lease ends or is reclaimed; histograms of
    rarer events served with a zero count until the first
    (services.common.metrics_at_start)."""
    show_from_start(_METER, _TAKEOVER, [{"expired_by": cause} for cause in ("ttl", "disconnect")])
    show_from_start(_METER, _QUEUE_WAIT)
    _claims.add(0)
    _releases.add(0)
    _wakes.add(0)
    _admission_rejections.add(0)
    for cause in ("ttl", "disconnect"):
        _reclaims.add(0, {"expired_by": cause})
        _expirations.add(0, {"by": cause})
    for outcome in ("done", "failed", "parked"):
        _finishes.add(0, {"outcome": outcome})


# The kernels of this process whose queues the gauge reports (one, but for
# tests): held weakly, so a stopped kernel drops out with its store.
_observed: weakref.WeakSet[KernelMetrics] = weakref.WeakSet()


def _observe_queues(options: CallbackOptions) -> Iterable[Observation]:
    # Called only when a reader collects (a scrape): no query otherwise.
    queued = waiting = 0
    for kernel in list(_observed):
        try:
            found, held_back = kernel.queue_depth()
        except Exception:  # the store is down: no sample, not a failed scrape
            log.debug("queue depth unavailable", exc_info=True)
            return
        queued, waiting = queued + found, waiting + held_back
    if _observed:
        yield Observation(queued - waiting, {"waiting_for": "runner"})
        yield Observation(waiting, {"waiting_for": "admission"})


_meter.create_observable_gauge(
    "keel.kernel.queue_depth",
    callbacks=[_observe_queues],
    description="sessions owing work that no lease holds (parked ones excluded), by what "
    "they wait for: a runner's claim, or a run slot of their tenant (admission: max "
    "concurrent runs reached)",
)


class KernelMetrics:
    """Records committed transitions to OpenTelemetry and to local totals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Counter[str] = Counter()
        self.queue_depth: Callable[[], tuple[int, int]] = lambda: (0, 0)

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
                expired_by = {"expired_by": str(transition.record.expired_by or "ttl")}
                _reclaims.add(1, expired_by)
                lost_for = transition.record.claimed_at_ms - transition.before.expires_at_ms
                _takeover.record(max(0, lost_for), expired_by)
                names.append("reclaims")
        elif event in (Event.WAKE, Event.CONTINUE):
            _wakes.add(1)
            _queue_wait.record(transition.duration_ms)
            names.append("wakes")
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

    def admission_rejected(self, count: int) -> None:
        """`count` claimable sessions found their tenant's run slots full."""
        # Not by tenant: the label set stays bounded however many tenants come.
        if count:
            _admission_rejections.add(count)

    def observe_queue(self, depth: Callable[[], tuple[int, int]]) -> None:
        """Reports the run queue when scraped: `depth()` is (runnable sessions
        nobody holds, those of them held back by their tenant's full slots)."""
        self.queue_depth = depth
        _observed.add(self)

    def totals(self) -> dict[str, int]:
        """claims, reclaims, releases, expirations_ttl/_disconnect, finishes_*."""
        with self._lock:
            return dict(self._totals)
