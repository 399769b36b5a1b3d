"""Logging and OpenTelemetry set-up, once per process.

Traces and metrics go nowhere by default (`KEEL_OTEL_EXPORTER=none`), to
the console with `console`, or to an OTLP collector with `otlp` (the standard
`OTEL_EXPORTER_OTLP_*` variables pick the endpoint; a signal without one is
not exported, and the process says so once at start).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from services.common import tracing
from services.common.config import Settings
from services.common.metrics_endpoint import MetricsEndpoint, start_metrics_endpoint
from services.common.outage_log import quiet_pool_retries

log = logging.getLogger(__name__)

_configured = False


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: easy to grep, easy to ship."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(
    service: str, settings: Settings, metrics_endpoint: MetricsEndpoint | None = None
) -> None:
    """Structured logs on stderr and the tracer/meter providers; with
    `metrics_endpoint`, the process's metrics also served there as Prometheus text."""
    global _configured
    if _configured:
        return
    _configured = True
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    quiet_pool_retries(settings.log_level)

    # The pid tells a crashed process's spans from its successor's.
    resource = Resource.create({"service.name": f"keel-{service}", "process.pid": os.getpid()})
    tracer_provider = TracerProvider(resource=resource)
    span_exporter, readers = _exporters(settings)
    if span_exporter is not None:
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        # Without an exporter the API's no-op tracer stays: no span is made.
        trace.set_tracer_provider(tracer_provider)
    tracing.enable(span_exporter is not None)
    if metrics_endpoint is not None:
        readers.append(start_metrics_endpoint(metrics_endpoint))
    if readers:
        # Without a reader the API's no-op meter stays: nothing is aggregated.
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))


def _exporters(settings: Settings) -> tuple[SpanExporter | None, list[MetricReader]]:
    """The span exporter and metric readers `KEEL_OTEL_EXPORTER` asks for.

    An OTLP signal without an endpoint is not exported at all, and one line
    at start says which variable is missing: the exporter's default
    (localhost:4317) would otherwise be tried and fail every few seconds,
    each time logged, where no collector was ever configured. A collector
    on that address is one variable away (OTEL_EXPORTER_OTLP_ENDPOINT)."""
    exporter = settings.otel_exporter.lower()
    if exporter == "none":
        return None, []
    if exporter == "console":
        return ConsoleSpanExporter(), [PeriodicExportingMetricReader(ConsoleMetricExporter())]
    if exporter != "otlp":
        log.warning(
            "KEEL_OTEL_EXPORTER=%s is not one of none, console, otlp: exporting nothing",
            settings.otel_exporter,
        )
        return None, []
    traces, metrics_to = settings.otlp_traces_endpoint, settings.otlp_metrics_endpoint
    if not traces and not metrics_to:
        log.warning(
            "KEEL_OTEL_EXPORTER=otlp but OTEL_EXPORTER_OTLP_ENDPOINT is not set (nor "
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_METRICS_ENDPOINT): "
            "exporting no traces and no metrics"
        )
        return None, []
    for signal, endpoint in (("TRACES", traces), ("METRICS", metrics_to)):
        if not endpoint:
            log.warning(
                "KEEL_OTEL_EXPORTER=otlp but OTEL_EXPORTER_OTLP_%s_ENDPOINT is not set (nor "
                "OTEL_EXPORTER_OTLP_ENDPOINT): exporting no %s",
                signal,
                signal.lower(),
            )
    log.info("exporting over OTLP: traces to %s, metrics to %s", traces or "-", metrics_to or "-")
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    span_exporter = OTLPSpanExporter(endpoint=traces) if traces else None
    readers: list[MetricReader] = []
    if metrics_to:
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=metrics_to)))
    return span_exporter, readers
