"""`GET /v1/runtime/status` by key: a tenant's admin sees its own sessions,
by the ids its clients use; an operator sees every tenant's, each with its
tenant, and where runtimes run. Draining needs an operator key."""

from __future__ import annotations

from typing import Any

from services.runner.server import RunnerServer
from tests.support.edge_stack import Stack
from tests.support.polling import eventually
from tests.support.runtime_status import key_holders, start_running, status


def held(report: dict[str, Any]) -> list[dict[str, str]]:
    sessions = [s for runtime in report["runtimes"] for s in runtime["sessions"]]
    return sorted(sessions, key=lambda s: (s.get("tenant", ""), s["id"]))


async def test_each_admin_sees_its_own_sessions_and_an_operator_sees_all(
    stack: Stack, runner: RunnerServer
) -> None:
    async with key_holders(stack) as (acme, globex, operator):
        await start_running(acme, "a-1")
        await start_running(globex, "g-1")
        both = [{"id": "a-1", "tenant": "acme"}, {"id": "g-1", "tenant": "globex"}]

        async def both_running() -> dict[str, Any] | None:
            report = await status(operator)
            return report if held(report) == both else None

        everything = await eventually(both_running, "both sessions to be running", 30)
        [entry] = [r for r in everything["runtimes"] if r["runtimeId"] == runner.runtime_id]
        assert entry["address"] == runner.target and entry["pid"] > 0 and entry["host"]

        for http, tenant, own, other in (
            (acme, "acme", "a-1", "globex"),
            (globex, "globex", "g-1", "acme"),
        ):
            response = await http.get("/v1/runtime/status")
            assert response.status_code == 200, response.text
            report = response.json()
            assert held(report) == [{"id": own}], tenant
            # Nothing of the other tenant, not even the ledger's `tenant:id` form.
            assert other not in response.text and f"{tenant}:" not in response.text
            runtime_ids = [r["runtimeId"] for r in report["runtimes"]]
            assert runner.runtime_id in runtime_ids
            for runtime in report["runtimes"]:
                assert {"drainMode", "claiming", "inFlightRuns"} <= runtime.keys()
                assert not {"host", "pid", "address"} & runtime.keys()


async def test_draining_needs_an_operator_key(stack: Stack, runner: RunnerServer) -> None:
    async with key_holders(stack) as (acme, _globex, operator):
        await start_running(acme, "a-1")
        refused = await acme.post(
            "/v1/runtime/drain", json={"mode": "handoff", "runtimeId": runner.runtime_id}
        )
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "forbidden"
        assert runner.runtime is not None and runner.runtime.claiming
        assert not stack.gateway.draining.is_set()

        drained = await operator.post(
            "/v1/runtime/drain",
            json={"mode": "shutdown", "deadlineMs": 1_000, "runtimeId": runner.runtime_id},
        )
        assert drained.status_code == 202, drained.text
        assert runner.runtime.drain_mode == "shutdown" and not runner.runtime.claiming
