"""Tenants, keys and a long-running turn for tests of `GET /v1/runtime/status`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from tests.support.edge_stack import Stack

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


async def make_keys(stack: Stack) -> None:
    kernel = stack.cluster.kernel
    for tenant in ("acme", "globex", "ops"):
        await kernel.create_tenant(tenant)
    await kernel.create_api_key("acme", ACME_ADMIN, admin=True)
    await kernel.create_api_key("globex", GLOBEX_ADMIN, admin=True)
    # An operator that administers no tenant's loadout.
    await kernel.create_api_key("ops", OPERATOR, operator=True)


@asynccontextmanager
async def key_holders(
    stack: Stack,
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, httpx.AsyncClient]]:
    """The tenants and keys of `make_keys`, and a client of the edge for each
    key: acme's admin, globex's admin and the operator (closed after)."""
    await make_keys(stack)
    acme, globex, operator = (stack.client(k) for k in (ACME_ADMIN, GLOBEX_ADMIN, OPERATOR))
    try:
        yield acme, globex, operator
    finally:
        for client in (acme, globex, operator):
            await client.aclose()
