"""A service's own `/metrics` port: its OpenTelemetry instruments as
Prometheus text.

Every service process records its instruments through OpenTelemetry (each
service's `metrics` module); a Prometheus reader turns them into text when
scraped, so the numbers cost nothing but the recording itself between
scrapes. The port is off unless the operator names one (`--metrics-port`
or `KEEL_METRICS_PORT`); it listens on `KEEL_METRICS_HOST` (loopback unless
told otherwise: the port has no authentication, unlike the edge's own
`/metrics` on its API port).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("keel.metrics")

METRICS_PORT_ENV = "KEEL_METRICS_PORT"
METRICS_HOST_ENV = "KEEL_METRICS_HOST"


@dataclass(frozen=True)
class MetricsEndpoint:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"


def start_metrics_endpoint(endpoint: MetricsEndpoint) -> PrometheusMetricReader:
    """Serves the process's metrics on `endpoint`; returns the reader to give
    the meter provider. Raises OSError when the port is taken."""
    # A registry of our own: prometheus_client's default one would add the
    # process and GC collectors of whatever else imported it.
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    start_http_server(endpoint.port, endpoint.host, registry=registry)
    # Services wait for this line as they wait for "listening on".
    log.info("metrics on %s", endpoint.url)
    return reader
