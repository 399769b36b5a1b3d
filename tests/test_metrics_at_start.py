"""A fresh Keel serves the series of rare events from its first scrape, at
zero: the dashboard's drain and compaction panels (and takeovers, the run
queue's wait) show 0, not "No data", until the first event; the ledger's
count of appends refused by the fence is there too.

`keel up --metrics-port` runs every service in one process and serves all of
their series on that port; nothing is sent to it before the scrape. Which
series each process of `keel up --processes` serves after a scenario, and
that the dashboard reads nothing no process serves, is
tests/test_metrics_endpoints.py.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.keel_up import keel_up
from tests.support.metrics import dashboard_metrics, scrape, total
from tests.support.ports import free_port

KEY = "metrics-at-start-key-0123456789abcdef"
# Histograms of rare events: served from the start with a count of zero.
AT_ZERO = (
    "keel_edge_drain_duration_milliseconds",
    "keel_runner_drain_duration_milliseconds",
    "keel_compaction_duration_milliseconds",
    "keel_kernel_takeover_latency_milliseconds",
    "keel_runner_takeover_first_commit_milliseconds",
)
# What only an event can name: a label whose values come with it (a
# provider, a tool source, a route answered).
NEED_AN_EVENT = {
    "keel_runner_provider_latency_milliseconds_bucket",
    "keel_runner_provider_first_event_milliseconds_bucket",
    "keel_runner_provider_tokens_total",
    "keel_runner_tool_latency_milliseconds_bucket",
    "keel_edge_requests_total",
}


async def test_a_fresh_keel_serves_rare_events_at_zero_before_any_happens(
    tmp_path: Path,
) -> None:
    port = free_port()
    with keel_up(tmp_path / "keel", KEY, "--metrics-port", str(port)):
        samples = await scrape(f"http://127.0.0.1:{port}/metrics")
    for histogram in AT_ZERO:
        counts = samples.get(f"{histogram}_count", [])
        assert counts, f"{histogram} is not served before its first event"
        assert total(samples, f"{histogram}_count") == 0
        assert f"{histogram}_bucket" in samples and f"{histogram}_sum" in samples
    # Both drain modes, so each line of the panel is there.
    modes = {labels["mode"] for labels, _ in samples["keel_edge_drain_duration_milliseconds_count"]}
    assert modes == {"handoff", "shutdown"}
    assert samples["keel_ledger_stale_appends_total"] == [
        (samples["keel_ledger_stale_appends_total"][0][0], 0.0)
    ]
    # Every other series the dashboard reads is there from the start.
    assert dashboard_metrics() - set(samples) <= NEED_AN_EVENT, dashboard_metrics() - set(samples)
