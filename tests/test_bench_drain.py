"""`keel bench drain` still measures what it says, at a size a test can
afford: every session held by one runner is handed to the other, with
nothing doubled (its times are reported by the benchmark, never asserted)."""

from __future__ import annotations

import pytest

from bench.drain import measure

pytestmark = pytest.mark.slow


def test_the_drain_benchmark_hands_every_session_over_without_duplicates(
    postgres_url: str,
) -> None:
    result = measure(postgres_url, sessions=5)
    assert result["benchmark"] == "drain" and result["sessions"] == 5
    # All five ran on the drained runner, and each has a successor.
    assert result["held_at_drain"] == 5 and result["handed_off"] == 5
    assert result["duplicates"] == 0 and result["violations"] == 0, result["violations_seen"]
    for figure in ("released_ms", "reclaimed_ms", "reclaimed_p50_ms", "handoff_gap_max_ms"):
        assert isinstance(result[figure], float) and result[figure] >= 0, figure
    assert result["targets"] == {"reclaimed_ms": 10_000, "duplicates": 0}
