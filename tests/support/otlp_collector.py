"""A real OTLP/gRPC collector on loopback that keeps the spans it is sent.

Processes under test export to it as to any collector
(`KEEL_OTEL_EXPORTER=otlp`, `OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint`):
the receiver is the `opentelemetry-proto` package's generated TraceService,
so what arrives went through the real exporter, wire format and all. Metrics
exports are accepted and dropped, so the exporters have nothing to complain
about.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    # "" for a root span.
    parent_span_id: str
    name: str
    # The exporting process's `service.name` (keel-edge, keel-runner, ...) and pid.
    service: str
    pid: int
    attributes: dict[str, Any]
    # (trace id, span id) of each link.
    links: tuple[tuple[str, str], ...]


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    return None if which is None else getattr(value, which)


def _attributes(pairs: Iterator[KeyValue] | Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OtlpCollector) -> None:
        self._collector = collector

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            service=str(resource.get("service.name", "")),
                            pid=int(resource.get("process.pid", 0)),
                            attributes=_attributes(span.attributes),
                            links=tuple((ln.trace_id.hex(), ln.span_id.hex()) for ln in span.links),
                        )
                    )
        self._collector.add(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def Export(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: Any
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpCollector:
    """Start with `start()`, point exporters at `endpoint`, read `spans()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(), self._server)
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpCollector:
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans() if s.trace_id == trace_id]

    def env(self) -> dict[str, str]:
        """What makes a Keel process export its spans here, without delay."""
        return {
            "KEEL_OTEL_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_METRIC_EXPORT_INTERVAL": "60000",
        }


def input_post_spans(collector: OtlpCollector, session: str) -> list[ReceivedSpan]:
    """The edge's server spans of the POSTs of inputs to `session`."""
    path = f"/v1/sessions/{session}/inputs"
    return [
        s
        for s in collector.spans()
        if s.service == "keel-edge"
        and not s.parent_span_id
        and any(isinstance(v, str) and v.endswith(path) for v in s.attributes.values())
    ]
