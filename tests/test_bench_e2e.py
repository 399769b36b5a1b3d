"""`keel bench e2e` still measures what it says, at a size a test can afford
(figures are reported by the benchmark itself, never asserted here)."""

from __future__ import annotations

from bench.e2e import measure


def test_the_e2e_benchmark_runs_end_to_end(postgres_url: str) -> None:
    result = measure(postgres_url, turns=3, clients=20, facts=2)
    for key in ("input_to_final_p50_ms", "input_to_final_p99_ms", "sse_1000_clients_p99_ms"):
        assert result[key] > 0, key
    assert result["sse_clients"] == 20
