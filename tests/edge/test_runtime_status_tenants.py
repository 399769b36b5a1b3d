"""`GET /v1/runtime/status` on a runner two tenants share: a tenant's admin
counts only its own runs in flight (the runner's count of every tenant's work
is the operator's), as it lists only its own sessions."""

from __future__ import annotations

from typing import Any

from services.runner.server import RunnerServer
from tests.support.edge_stack import Stack
from tests.support.polling import eventually
from tests.support.runtime_status import key_holders, start_running, status


def runner_entry(report: dict[str, Any], runner: RunnerServer) -> dict[str, Any]:
    [entry] = [r for r in report["runtimes"] if r["runtimeId"] == runner.runtime_id]
    return entry


async def test_a_tenant_admin_counts_only_its_own_runs_in_flight(
    stack: Stack, runner: RunnerServer
) -> None:
    async with key_holders(stack) as (acme, globex, operator):
        await start_running(acme, "a-1")
        for session in ("g-1", "g-2"):
            await start_running(globex, session)

        # The runs in flight are the runner's own count, the sessions the
        # kernel's list of the leases it holds: each catches up on its own.
        async def all_three_running() -> dict[str, Any] | None:
            entry = runner_entry(await status(operator), runner)
            seen = (entry["liveness"], entry["inFlightRuns"], len(entry["sessions"]))
            return entry if seen == ("live", 3, 3) else None

        await eventually(all_three_running, "three runs in flight, three sessions held", 30)

        for http, own in ((acme, ["a-1"]), (globex, ["g-1", "g-2"])):
            report = await status(http)
            entry = runner_entry(report, runner)
            assert entry["liveness"] == "live"
            assert sorted(s["id"] for s in entry["sessions"]) == own
            # The count is the admin's own runs, not the runner's total.
            assert entry["inFlightRuns"] == len(own), entry
            assert sum(r["inFlightRuns"] for r in report["runtimes"]) == len(own)
