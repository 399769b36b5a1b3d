"""`keel bench e2e` still measures what it says, at a size a test can afford
(figures are reported by the benchmark itself, never asserted here)."""

from __future__ import annotations

import pytest

from bench.e2e import measure

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow


def test_the_e2e_benchmark_runs_end_to_end(postgres_url: str) -> None:
    result = measure(postgres_url, turns=3, clients=20, facts=2)
    # Both front doors by default, each named in the result.
    assert result["transports"] == ["http", "grpc"]
    for transport in ("http", "grpc"):
        figures = result["input_to_final"][transport]
        assert figures["p50_ms"] > 0 and figures["p99_ms"] >= figures["p50_ms"], transport
    assert result["sse_1000_clients_p99_ms"] > 0
    assert result["sse_clients"] == 20


def test_the_e2e_benchmark_times_one_front_door(postgres_url: str) -> None:
    result = measure(postgres_url, turns=2, clients=5, facts=1, transport="grpc")
    assert result["transports"] == ["grpc"]
    assert set(result["input_to_final"]) == {"grpc"}
    assert result["input_to_final"]["grpc"]["p50_ms"] > 0
    # The SSE fan-out figure belongs to the HTTP door only.
    assert "sse_clients" not in result
