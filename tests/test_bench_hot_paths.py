"""`keel bench turns`, `ledger` and `rebuild` still measure what they say, at
a size a test can afford (figures are reported by the benchmarks, never
asserted here): a turn's CPU and its calls and commits, the stream against
the unary append, a successor's cold rebuild."""

from __future__ import annotations

import pytest

from bench.ledger import measure as measure_ledger
from bench.rebuild import measure as measure_rebuild
from bench.turns import measure as measure_turns


def test_the_turns_benchmark_reports_cpu_calls_and_commits(postgres_url: str) -> None:
    result = measure_turns(postgres_url, sessions=1, turns=3)
    assert result["turns_per_s"] > 0 and result["latency_p50_ms"] > 0
    assert result["cpu_ms_per_turn"] > 0
    # A turn is some calls and commits, each broken down by where it went.
    # (each figure rounded to two places on its own)
    assert abs(result["calls_per_turn"] - sum(result["calls_by_method"].values())) < 0.05
    assert abs(result["commits_per_turn"] - sum(result["commits_by_store"].values())) < 0.05
    assert result["calls_by_method"]["keel.ledger.v1.LedgerService/AppendStream"] >= 2
    assert set(result["commits_by_store"]) == {"kernel", "ledger"}


@pytest.mark.slow
def test_the_turns_benchmark_splits_the_services_over_processes(postgres_url: str) -> None:
    """`--layout split`: every answer came through a ledger, a kernel and a
    runner in processes of their own, and each one's CPU is told apart."""
    result = measure_turns(postgres_url, sessions=2, turns=2, layout="split")
    assert result["layout"] == "split" and result["turns_per_s"] > 0
    by_process = result["cpu_ms_per_turn_by_process"]
    assert set(by_process) == {"ledger", "kernel", "runner", "client"}
    assert all(spent > 0 for spent in by_process.values()), by_process


def test_the_ledger_benchmark_compares_the_stream_with_unary_calls(postgres_url: str) -> None:
    result = measure_ledger(postgres_url, count=40)
    for figure in ("raw_insert_per_s", "single_session_per_s", "single_session_unary_per_s"):
        assert result[figure] > 0, figure
    assert set(result["cpu_us_per_append"]) == {"single", "single_unary", "concurrent_64"}
    # The floor's stand-ins served and answered: a round trip, and one with a
    # durable write behind it.
    floor = result["floor"]
    assert floor["grpc_round_trip_per_s"] > 0 and floor["grpc_plus_commit_per_s"] > 0
    assert floor["grpc_plus_commit_vs_raw"] > 0


def test_the_rebuild_benchmark_reads_and_rebuilds_a_whole_session(postgres_url: str) -> None:
    result = measure_rebuild(postgres_url, facts=120, runs=3)
    assert result["rebuilt_facts"] == 120
    assert result["presented_messages"] > 0
    assert result["total_ms"]["p50"] > 0 and result["targets"]["total_ms"] == 100.0
