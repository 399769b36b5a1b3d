"""The edge's OpenTelemetry instruments (meter `keel.edge`), served on the
process's own metrics port.

The edge's API also answers `/metrics` itself (behind the operator key, from
`edge.http.Metrics`); these instruments are the same numbers and more, in
the one mechanism every service shares.
"""

from __future__ import annotations

import time

from opentelemetry import metrics

from kernel.domain import DrainMode
from services.common.metrics_at_start import HistogramSpec, show_from_start

_meter = metrics.get_meter("keel.edge")
_requests = _meter.create_counter(
    "keel.edge.requests",
    description="HTTP requests answered, by route and status (429: refused by a limit; "
    "499: the client left first)",
)
_sse_clients = _meter.create_up_down_counter(
    "keel.edge.sse_clients", description="SSE streams open now"
)
_sse_frames = _meter.create_counter(
    "keel.edge.sse_frames",
    description="SSE events sent to clients (facts, partials, status, drain), summed over clients",
)
_DRAIN_DURATION = HistogramSpec(
    "keel.edge.drain_duration",
    unit="ms",
    description="a runner's drain as the operator's drain request saw it, from the call to "
    "the runner's answer that it finished (or failed), by mode and result",
)
_drain_duration = _DRAIN_DURATION.create(_meter)


def prime() -> None:
    """Instruments at 0 from the start (see kernel.metrics.prime); the drain
    histogram with a zero count until the first drain."""
    modes = [
        {"mode": mode.value, "result": "drained"}
        for mode in (DrainMode.HANDOFF, DrainMode.SHUTDOWN)
    ]
    show_from_start("keel.edge", _DRAIN_DURATION, modes)
    _sse_clients.add(0)
    _sse_frames.add(0)


def request_answered(route: str, status: int) -> None:
    _requests.add(1, {"route": route, "status": str(status)})


def sse_client_opened() -> None:
    _sse_clients.add(1)


def sse_client_closed() -> None:
    _sse_clients.add(-1)


def sse_frames_sent(count: int) -> None:
    if count:
        _sse_frames.add(count)


def drain_answered(mode: DrainMode, started: float, result: str) -> None:
    """A runner's drain, called at `started` (`time.perf_counter()`), ended as `result`."""
    _drain_duration.record(
        (time.perf_counter() - started) * 1000, {"mode": mode.value, "result": result}
    )
