"""`keel bench fork` runs and reports both figures (small session, few runs)."""

from __future__ import annotations

import pytest

from bench.fork import measure

pytestmark = pytest.mark.slow


def test_the_fork_benchmark_reports_fork_and_read_times(postgres_url: str) -> None:
    result = measure(postgres_url, facts=60, runs=3)
    assert result["benchmark"] == "fork" and result["facts"] == 60
    assert 0 < result["fork_ms_min"] <= result["fork_ms_p50"]
    assert 0 < result["read_ms_min"] <= result["read_ms_p50"]
