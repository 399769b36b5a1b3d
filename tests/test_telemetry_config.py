"""`KEEL_OTEL_EXPORTER=otlp` says once what it lacks and exports only where
it can: a process told to export over OTLP with no endpoint logs one line at
start naming the missing variable and starts no exporter (the default
localhost:4317 would fail, logged, every few seconds); with an endpoint, its
spans reach that collector.

Each case is a fresh interpreter, as a service process is: telemetry is
configured once per process and its providers are process-global."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.otlp_collector import OtlpCollector

# What a service does at start (services/cli/main.py `_serve`), then one span
# through the shared helper and the state an operator's set-up leads to.
PROCESS = """
import json
from opentelemetry import metrics, trace
from services.common import telemetry, tracing
from services.common.config import Settings

settings = Settings.from_env()
telemetry.configure("ledger", settings)
with tracing.span("probe"):
    pass
provider = trace.get_tracer_provider()
print(json.dumps({
    "tracing": tracing.enabled(),
    "interceptors": settings.tracing,
    "sdk_tracer": type(provider).__module__.startswith("opentelemetry.sdk"),
    "sdk_meter": type(metrics.get_meter_provider()).__module__.startswith("opentelemetry.sdk"),
}))
if hasattr(provider, "shutdown"):
    provider.shutdown()
"""


def run_service_start(extra_env: dict[str, str]) -> tuple[dict[str, bool], list[str]]:
    """Runs PROCESS; its reported state and its log lines (stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KEEL_OTEL"))}
    env.update(extra_env)
    done = subprocess.run(
        [sys.executable, "-c", PROCESS], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr.splitlines()


@pytest.fixture
def collector() -> Iterator[OtlpCollector]:
    started = OtlpCollector().start()
    yield started
    started.stop()


def test_otlp_without_an_endpoint_says_so_once_and_exports_nothing() -> None:
    state, lines = run_service_start({"KEEL_OTEL_EXPORTER": "otlp"})
    naming = [line for line in lines if "OTEL_EXPORTER_OTLP_ENDPOINT" in line]
    assert len(naming) == 1, lines
    entry = json.loads(naming[0])
    assert entry["level"] == "warning"
    assert "KEEL_OTEL_EXPORTER=otlp" in entry["msg"]
    # Nothing started that could fail later: no SDK provider, no spans made,
    # no gRPC instrumentation.
    assert state == {
        "tracing": False,
        "interceptors": False,
        "sdk_tracer": False,
        "sdk_meter": False,
    }, state


def test_otlp_with_an_endpoint_exports_there_quietly(collector: OtlpCollector) -> None:
    state, lines = run_service_start(collector.env())
    assert state["tracing"] and state["interceptors"] and state["sdk_tracer"], state
    assert not [line for line in lines if "not set" in line], lines
    # Shut down before the process exited, so its batch was sent by then.
    assert [(s.name, s.service) for s in collector.spans()] == [("probe", "keel-ledger")]
