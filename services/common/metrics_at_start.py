"""Histograms that are served from the first scrape, with a count of zero.

A counter is primed with `add(0)` (each service's `metrics.prime`), so its
series exists before the first event and a dashboard panel over it shows 0,
not "No data". OpenTelemetry has no such thing for a histogram: its series
appears with its first recorded value, and until then a panel of drain or
compaction durations (events an hour or a week apart) shows nothing, which
reads as "not collected".

So a service declares, when it primes, the histograms it records and the
attribute sets they take (`show_from_start`), and the process's Prometheus
reader (`StartingAtZero`) adds a data point with a zero count for each
declared series the SDK has no data for yet. Once the first value is
recorded the SDK's own point replaces it, with the same name, labels,
buckets and help text. Only the Prometheus endpoint does this; OTLP
exporters send what the SDK has.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Histogram, Meter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

# The SDK's default buckets, for histograms that name none of their own.
DEFAULT_BOUNDARIES = (
    0.0,
    5.0,
    10.0,
    25.0,
    50.0,
    75.0,
    100.0,
    250.0,
    500.0,
    750.0,
    1000.0,
    2500.0,
    5000.0,
    7500.0,
    10000.0,
)

Attributes = Mapping[str, str]
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class HistogramSpec:
    """A histogram's name, unit and help text: the one definition both the
    instrument and its zero series are made from."""

    name: str
    unit: str
    description: str
    # Its buckets (also advised to the SDK); None: the SDK's default.
    boundaries: tuple[float, ...] | None = None

    def create(self, meter: Meter) -> Histogram:
        if self.boundaries is None:
            return meter.create_histogram(self.name, unit=self.unit, description=self.description)
        return meter.create_histogram(
            self.name,
            unit=self.unit,
            description=self.description,
            explicit_bucket_boundaries_advisory=list(self.boundaries),
        )


@dataclass(frozen=True)
class _Declared:
    scope: str
    spec: HistogramSpec
    attribute_sets: tuple[Labels, ...]


_lock = threading.Lock()
_declared: dict[tuple[str, str], _Declared] = {}
_started_ns = time.time_ns()


def show_from_start(
    meter_name: str, spec: HistogramSpec, attribute_sets: Sequence[Attributes] = ({},)
) -> None:
    """Serves `spec`'s series for each of `attribute_sets` from now on, with
    a zero count until values are recorded (the meter is `meter_name`)."""
    sets = tuple(tuple(sorted(attributes.items())) for attributes in attribute_sets)
    with _lock:
        _declared[(meter_name, spec.name)] = _Declared(meter_name, spec, sets)


def _zero_point(attributes: Labels, bounds: Sequence[float]) -> HistogramDataPoint:
    return HistogramDataPoint(
        attributes=dict(attributes),
        start_time_unix_nano=_started_ns,
        time_unix_nano=time.time_ns(),
        count=0,
        sum=0,
        bucket_counts=[0] * (len(bounds) + 1),
        explicit_bounds=list(bounds),
        min=math.inf,
        max=-math.inf,
    )


def _filled(metric: Metric | None, declared: _Declared) -> Metric | None:
    """`metric` with a zero point for each declared attribute set it lacks
    (a new metric when the SDK has none); None when nothing is missing."""
    spec = declared.spec
    points: list[HistogramDataPoint] = []
    if metric is not None:
        if not isinstance(metric.data, HistogramData):
            return None
        points = list(metric.data.data_points)
    present = {tuple(sorted((k, str(v)) for k, v in (p.attributes or {}).items())) for p in points}
    missing = [attributes for attributes in declared.attribute_sets if attributes not in present]
    if not missing:
        return None
    bounds = list(points[0].explicit_bounds) if points else spec.boundaries or DEFAULT_BOUNDARIES
    points.extend(_zero_point(attributes, bounds) for attributes in missing)
    data = HistogramData(
        data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
    )
    if metric is None:
        return Metric(name=spec.name, description=spec.description, unit=spec.unit, data=data)
    return dataclasses.replace(metric, data=data)


def _with_scope(scopes: list[ScopeMetrics], declared: _Declared) -> list[ScopeMetrics]:
    for index, scope in enumerate(scopes):
        if scope.scope.name != declared.scope:
            continue
        metrics = list(scope.metrics)
        names = [m.name for m in metrics]
        at = names.index(declared.spec.name) if declared.spec.name in names else None
        filled = _filled(metrics[at] if at is not None else None, declared)
        if filled is None:
            return scopes
        if at is None:
            metrics.append(filled)
        else:
            metrics[at] = filled
        scopes[index] = dataclasses.replace(scope, metrics=metrics)
        return scopes
    filled = _filled(None, declared)
    assert filled is not None
    scopes.append(ScopeMetrics(InstrumentationScope(declared.scope), [filled], schema_url=""))
    return scopes


def with_declared(data: MetricsData) -> MetricsData:
    """`data` with the zero series of every declared histogram it lacks
    (added to its first resource: a process has one)."""
    with _lock:
        declared = list(_declared.values())
    if not declared or not data.resource_metrics:
        return data
    first, *rest = data.resource_metrics
    scopes = list(first.scope_metrics)
    for one in declared:
        scopes = _with_scope(scopes, one)
    resource: ResourceMetrics = dataclasses.replace(first, scope_metrics=scopes)
    return MetricsData(resource_metrics=[resource, *rest])


class StartingAtZero(PrometheusMetricReader):
    """The Prometheus reader, serving the declared histograms from the start."""

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> None:
        if metrics_data is not None:
            metrics_data = with_declared(metrics_data)
        super()._receive_metrics(metrics_data, timeout_millis, **kwargs)
