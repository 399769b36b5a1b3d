"""`GET /v1/runtime/status` by key: a tenant's admin sees its own sessions,
by the ids its clients use; an operator sees every tenant's, each with its
tenant, and where runtimes run. Draining needs an operator key."""

from __future__ import annotations

from typing import Any

import httpx

from services.runner.server import RunnerServer
from tests.edge.conftest import Stack
from tests.runner.cluster import eventually

ACME_ADMIN = "acme-admin-key-0123456789"
GLOBEX_ADMIN = "globex-admin-key-0123456789"
OPERATOR = "ops-operator-key-0123456789"
# Long enough to be running whenever the test looks; the runner is stopped
# (the attempt abandoned) when the test ends.
SLOW = "/slow 60 one two three four five six seven eight"


async def start_running(http: httpx.AsyncClient, session_id: str) -> None:
    created = await http.post("/v1/sessions", json={"id": session_id})
    assert created.status_code == 201, created.text
    posted = await http.post(
        f"/v1/sessions/{session_id}/inputs", json={"text": SLOW, "requestId": f"{session_id}-1"}
    )
    assert posted.status_code == 202, posted.text


async def status(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.get("/v1/runtime/status")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def held(report: dict[str, Any]) -> list[dict[str, str]]:
    sessions = [s for runtime in report["runtimes"] for s in runtime["sessions"]]
    return sorted(sessions, key=lambda s: (s.get("tenant", ""), s["id"]))


async def make_keys(stack: Stack) -> None:
    kernel = stack.cluster.kernel
    for tenant in ("acme", "globex", "ops"):
        await kernel.create_tenant(tenant)
    await kernel.create_api_key("acme", ACME_ADMIN, admin=True)
    await kernel.create_api_key("globex", GLOBEX_ADMIN, admin=True)
    # An operator that administers no tenant's loadout.
    await kernel.create_api_key("ops", OPERATOR, operator=True)


async def test_each_admin_sees_its_own_sessions_and_an_operator_sees_all(
    stack: Stack, runner: RunnerServer
) -> None:
    await make_keys(stack)
    acme, globex, operator = (stack.client(k) for k in (ACME_ADMIN, GLOBEX_ADMIN, OPERATOR))
    try:
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
    finally:
        for client in (acme, globex, operator):
            await client.aclose()


async def test_draining_needs_an_operator_key(stack: Stack, runner: RunnerServer) -> None:
    await make_keys(stack)
    acme, operator = stack.client(ACME_ADMIN), stack.client(OPERATOR)
    try:
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
    finally:
        for client in (acme, operator):
            await client.aclose()
