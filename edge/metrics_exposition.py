"""What the edge's `/metrics` answers: its own registry and every other
series of the process it runs in.

The edge counts its requests and SSE streams in a registry of its own
(`edge.http.Metrics`). The process's OpenTelemetry instruments are read into
the process's registry (services/common/metrics_endpoint.py): under an
embedded `keel up`, where the ledger, kernel, runners and compaction run in
the edge's process, that is their series too, which the edge's `/metrics`
then shows beside its own (before, they existed only on `--metrics-port`).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from services.common.metrics_endpoint import process_registry


class _Combined:
    """The edge's own registry, then the process's series it does not have
    (the same name twice would make the text invalid: the edge's own wins)."""

    def __init__(self, own: CollectorRegistry, shared: CollectorRegistry) -> None:
        self.own = own
        self.shared = shared

    def collect(self) -> Iterator[Metric]:
        names: set[str] = set()
        for family in self.own.collect():
            names.add(family.name)
            yield family
        for family in self.shared.collect():
            if family.name not in names:
                yield family


def exposition(own: CollectorRegistry) -> bytes:
    """The Prometheus text of the edge's `/metrics`: `own` and every other
    series this process records."""
    shared = process_registry()
    if shared is None:
        return generate_latest(own)
    return generate_latest(_Combined(own, shared))
