"""The ledger's count of appends refused by the fence is charted and
explained (issue 24, point 20): a panel of the dashboard reads it, and the
runbook says what a rise of it means. That the ledger serves it at zero from
its first scrape is tests/test_metrics_at_start.py."""

from __future__ import annotations

from tests.support.metrics import dashboard_metrics
from tests.support.processes import ROOT

STALE_APPENDS = "keel_ledger_stale_appends_total"


def test_the_stale_append_counter_is_on_the_dashboard_and_in_the_runbook() -> None:
    assert STALE_APPENDS in dashboard_metrics()
    runbook = (ROOT / "deploy" / "RUNBOOK.md").read_text()
    assert f"## Fenced writers: `{STALE_APPENDS}`" in runbook
