"""Every answer carries the browser hygiene headers; operations are the
operator's.

Attacks reproduced:
- no `X-Content-Type-Options`, no `frame-ancestors` / `X-Frame-Options`: the
  page could be framed by another site, answers sniffed;
- `/metrics` was open to anyone reaching the port;
- a tenant's admin drained the shared runtime (`/readyz` turned 503) and
  read where runtimes run.
"""

from __future__ import annotations

import httpx

from services.runner.server import RunnerServer
from tests.support.edge_stack import DEADLINE_S, Stack
from tests.support.slow_clients import RawClient, status_of

TENANT_ADMIN = "acme-tenant-admin-key-abcdefghij"


def assert_hygiene(response: httpx.Response, what: str) -> None:
    headers = response.headers
    assert headers.get("x-content-type-options") == "nosniff", what
    assert headers.get("x-frame-options") == "DENY", what
    assert headers.get("referrer-policy") == "no-referrer", what
    policy = headers.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in policy, (what, policy)


async def test_every_answer_carries_the_security_headers(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session()
    blob = (await http.post("/v1/blobs", json={"length": 3})).json()["id"]
    uploaded = await http.patch(f"/v1/blobs/{blob}", content=b"abc", headers={"Upload-Offset": "0"})
    assert uploaded.status_code == 200, uploaded.text
    async with httpx.AsyncClient(base_url=stack.url, timeout=DEADLINE_S) as anonymous:
        answers = {
            "page": await anonymous.get("/"),
            "module": await anonymous.get("/static/chat.js"),
            "healthz": await anonymous.get("/healthz"),
            "readyz": await anonymous.get("/readyz"),
            "openapi": await anonymous.get("/openapi.json"),
            "401": await anonymous.get("/v1/sessions"),
            "201": await http.post("/v1/sessions", json={}),
            "400": await http.post("/v1/sessions", content=b"{nope"),
            "404": await http.get("/v1/nope"),
            "405": await http.get(f"/v1/sessions/{session}/inputs"),
            "blob content": await http.get(f"/v1/blobs/{blob}/content"),
            "metrics": await http.get("/metrics"),
        }
        async with http.stream("GET", f"/v1/sessions/{session}/events") as stream:
            assert stream.status_code == 200
            answers["sse"] = stream
    for what, response in answers.items():
        assert_hygiene(response, what)

    # The page may load its own modules and styles, and nothing from elsewhere.
    page_policy = answers["page"].headers["content-security-policy"]
    for directive in ("script-src 'self'", "style-src 'self'", "connect-src 'self'"):
        assert directive in page_policy
    # Data is allowed nothing; an uploaded file keeps its sandbox.
    assert "default-src 'none'" in answers["201"].headers["content-security-policy"]
    assert "sandbox" in answers["blob content"].headers["content-security-policy"]

    # uvicorn's own answer to a malformed request carries them too.
    raw = await RawClient.connect(stack.edge.port)
    await raw.send(b"NOT HTTP AT ALL\r\n\r\n")
    answer = await raw.closed_by_server(DEADLINE_S)
    assert status_of(answer) == 400
    assert b"x-frame-options: DENY" in answer


async def test_metrics_need_an_operator_key(stack: Stack) -> None:
    await stack.cluster.kernel.create_tenant("acme")
    await stack.cluster.kernel.create_api_key("acme", TENANT_ADMIN, admin=True)
    async with (
        httpx.AsyncClient(base_url=stack.url, timeout=DEADLINE_S) as anonymous,
        stack.client(TENANT_ADMIN) as tenant_admin,
    ):
        assert (await anonymous.get("/metrics")).status_code == 401
        forbidden = await tenant_admin.get("/metrics")
        assert forbidden.status_code == 403, forbidden.text
        assert "keel_edge_requests" not in forbidden.text
    operator = await stack.http.get("/metrics")
    assert operator.status_code == 200
    assert "keel_edge_requests_total" in operator.text


async def test_a_tenant_admin_drains_nothing(stack: Stack, runner: RunnerServer) -> None:
    await stack.cluster.kernel.create_tenant("acme")
    await stack.cluster.kernel.create_api_key("acme", TENANT_ADMIN, admin=True)
    async with stack.client(TENANT_ADMIN) as tenant_admin:
        # This whole runtime (no runtimeId), then the runner by id.
        for body in ({}, {"mode": "shutdown", "runtimeId": runner.runtime_id}):
            drained = await tenant_admin.post("/v1/runtime/drain", json=body)
            assert drained.status_code == 403, drained.text
        status = await tenant_admin.get("/v1/runtime/status")
        assert status.status_code == 200
        for runtime in status.json()["runtimes"]:
            assert not {"host", "pid", "address"} & runtime.keys()
            assert runtime["sessions"] == []
    assert not stack.gateway.draining.is_set()
    assert runner.runtime is not None and runner.runtime.claiming
    assert runner.runtime.drain_mode == "none"
    async with httpx.AsyncClient(base_url=stack.url, timeout=DEADLINE_S) as anonymous:
        ready = await anonymous.get("/readyz")
    assert ready.status_code == 200, ready.text
