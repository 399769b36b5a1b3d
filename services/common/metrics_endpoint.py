"""A service's own `/metrics` port: its OpenTelemetry instruments as
Prometheus text.

Every service process records its instruments through OpenTelemetry (each
service's `metrics` module); a Prometheus reader turns them into text when
scraped, so the numbers cost nothing but the recording itself between
scrapes. The port is off unless the operator names one (`--metrics-port`
or `KEEL_METRICS_PORT`); it listens on `KEEL_METRICS_HOST` (loopback unless
told otherwise: the port has no authentication, unlike the edge's own
`/metrics` on its API port).

The registry the reader fills is the process's (`process_registry`): an
edge in the same process serves it on its own `/metrics` too, so under an
embedded `keel up` (every service in one process) the edge's `/metrics`
shows the ledger's, kernel's, runners' and compaction's series as well,
with or without a port of their own (an endpoint without a port only fills
the registry).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, start_http_server

from services.common import settings_registry as registry
from services.common.metrics_at_start import StartingAtZero

log = logging.getLogger(__name__)

METRICS_PORT_ENV = registry.KEEL_METRICS_PORT.name
METRICS_HOST_ENV = registry.KEEL_METRICS_HOST.name


_process_registry: CollectorRegistry | None = None


@dataclass(frozen=True)
class MetricsEndpoint:
    host: str
    # None: the process's registry is filled, but served on no port of its own.
    port: int | None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"


def start_metrics_endpoint(endpoint: MetricsEndpoint) -> PrometheusMetricReader:
    """Serves the process's metrics on `endpoint`; returns the reader to give
    the meter provider. Raises OSError when the port is taken."""
    global _process_registry
    # A registry of our own: prometheus_client's default one would add the
    # process and GC collectors of whatever else imported it.
    registry = CollectorRegistry()
    # Rare events' histograms show from the first scrape, at zero.
    reader = StartingAtZero(registry=registry)
    if endpoint.port is not None:
        start_http_server(endpoint.port, endpoint.host, registry=registry)
        # Services wait for this line as they wait for "listening on".
        log.info("metrics on %s", endpoint.url)
    _process_registry = registry
    return reader


def process_registry() -> CollectorRegistry | None:
    """The registry this process's instruments are read into, if any."""
    return _process_registry
