"""Logging and OpenTelemetry set-up, once per process.

Traces and metrics go nowhere by default (`KEEL_OTEL_EXPORTER=none`), to
the console with `console`, or to an OTLP collector with `otlp` (the standard
`OTEL_EXPORTER_OTLP_*` variables pick the endpoint).
"""

from __future__ import annotations

import json
import logging
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

from services.common.config import Settings

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


def configure(service: str, settings: Settings) -> None:
    """Structured logs on stderr and the tracer/meter providers."""
    global _configured
    if _configured:
        return
    _configured = True
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())

    resource = Resource.create({"service.name": f"keel-{service}"})
    exporter = settings.otel_exporter.lower()
    tracer_provider = TracerProvider(resource=resource)
    readers: list[MetricReader] = []
    span_exporter: SpanExporter | None = None
    if exporter == "console":
        span_exporter = ConsoleSpanExporter()
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter()
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if span_exporter is not None:
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
