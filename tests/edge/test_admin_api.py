"""Tenant configuration over real HTTP: GET/PUT /v1/loadout (with If-Match),
/v1/tenants and /v1/keys, with operator, admin and plain keys.

The stack's key (conftest ADMIN_KEY) is tenant "default"'s admin and an
operator; other keys are made here through the API itself.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.edge_stack import Stack
from tests.support.polling import eventually

LOADOUT: dict[str, Any] = {
    "systemPrompt": "You answer in one line.",
    "model": {"provider": "scripted", "name": "scripted-1", "tokenDelayMs": 0},
    "compaction": {"enabled": True},
    "tools": [{"source": "builtin", "names": ["clock"]}],
}


async def _create_key(
    http: httpx.AsyncClient, tenant: str | None = None, **rights: bool
) -> dict[str, Any]:
    body: dict[str, Any] = dict(rights)
    if tenant is not None:
        body["tenant"] = tenant
    response = await http.post("/v1/keys", json=body)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def _error(response: httpx.Response) -> dict[str, str]:
    error: dict[str, str] = response.json()["error"]
    return error


async def test_the_loadout_is_read_and_written_with_its_revision(stack: Stack) -> None:
    http = stack.http
    first = await http.get("/v1/loadout")
    assert first.status_code == 200, first.text
    assert first.json()["revision"] == 0  # none stored: the default document
    assert first.headers["etag"] == '"0"'

    stored = await http.put("/v1/loadout", json=LOADOUT)
    assert stored.status_code == 200, stored.text
    revision = stored.json()["revision"]
    assert revision >= 1 and stored.headers["etag"] == f'"{revision}"'
    read = (await http.get("/v1/loadout")).json()
    assert read == {"revision": revision, "document": LOADOUT}
    # The kernel's stored revision is what the API reports.
    assert (await stack.cluster.kernel.get_loadout("default")).revision == revision

    # If-Match: the ETag as sent, or the bare number.
    changed = {**LOADOUT, "systemPrompt": "You answer in two lines."}
    second = await http.put("/v1/loadout", json=changed, headers={"If-Match": f'"{revision}"'})
    assert second.status_code == 200, second.text
    assert second.json()["revision"] == revision + 1

    # A writer that read `revision` lost the race: refused, nothing stored.
    stale = await http.put("/v1/loadout", json=LOADOUT, headers={"If-Match": str(revision)})
    assert stale.status_code == 412, stale.text
    assert _error(stale)["code"] == "precondition_failed"
    assert (await http.get("/v1/loadout")).json() == {
        "revision": revision + 1,
        "document": changed,
    }
    bad = await http.put("/v1/loadout", json=LOADOUT, headers={"If-Match": "latest"})
    assert bad.status_code == 400 and "If-Match" in _error(bad)["message"]


async def test_an_invalid_loadout_is_refused_naming_the_field(stack: Stack) -> None:
    http = stack.http
    before = (await http.put("/v1/loadout", json=LOADOUT)).json()["revision"]
    cases: list[tuple[Any, str]] = [
        ({"model": {"provider": "openia", "name": "gpt"}}, "model.provider"),
        ({"sytemPrompt": "typo"}, "sytemPrompt"),
        ({"compaction": {"threshold": "high"}}, "compaction.threshold"),
        (
            {"tools": ["clock", {"source": "mcp", "name": "files", "transport": "pigeon"}]},
            "tools[1].transport",
        ),
        # Secrets only by env-var name: a key value has no field to go in.
        ({"model": {"provider": "openai", "name": "gpt", "apiKey": "sk-123"}}, "model.apiKey"),
        ({"model": {"provider": "openai", "name": "gpt", "apiKeyEnv": "KEEL_DEV_KEY"}}, "model"),
    ]
    for document, field in cases:
        response = await http.put("/v1/loadout", json=document)
        assert response.status_code == 400, (document, response.text)
        error = _error(response)
        assert error["code"] == "invalid_loadout", error
        assert field in error["message"], (field, error)
    for body, headers in (
        (b"{not json", {"Content-Type": "application/json"}),
        (b"[1, 2]", {"Content-Type": "application/json"}),
        (b"systemPrompt: yaml", {"Content-Type": "application/yaml"}),
    ):
        response = await http.put("/v1/loadout", content=body, headers=headers)
        # Not JSON by its Content-Type: 415 (tests/edge/test_json_content_type.py).
        assert response.status_code in (400, 415), (body, response.text)
    # Nothing refused was stored.
    assert (await http.get("/v1/loadout")).json()["revision"] == before


async def test_the_loadout_needs_an_admin_key_of_the_tenant(stack: Stack) -> None:
    operator_tenant = stack.http
    assert (await operator_tenant.post("/v1/tenants", json={"id": "acme"})).status_code == 201
    acme = await _create_key(operator_tenant, "acme", admin=True)
    plain = await _create_key(operator_tenant)
    await operator_tenant.put("/v1/loadout", json=LOADOUT)
    async with stack.client(acme["key"]) as acme_http, stack.client(plain["key"]) as plain_http:
        # Each tenant has its own loadout.
        assert (await acme_http.get("/v1/loadout")).json()["revision"] == 0
        stored = await acme_http.put("/v1/loadout", json={"systemPrompt": "acme"})
        assert stored.status_code == 200, stored.text
        assert (await acme_http.get("/v1/loadout")).json()["document"] == {"systemPrompt": "acme"}
        assert (await operator_tenant.get("/v1/loadout")).json()["document"] == LOADOUT
        for response in (
            await plain_http.get("/v1/loadout"),
            await plain_http.put("/v1/loadout", json=LOADOUT),
        ):
            assert response.status_code == 403, response.text


async def test_tenants_are_managed_by_operators_only(stack: Stack) -> None:
    http = stack.http
    created = await http.post("/v1/tenants", json={"id": "acme", "name": "Acme Inc."})
    assert created.status_code == 201, created.text
    assert created.json() == {"id": "acme", "name": "Acme Inc.", "created": True}
    again = await http.post("/v1/tenants", json={"id": "acme", "name": "Acme Inc."})
    assert again.status_code == 200 and again.json()["created"] is False
    listed = (await http.get("/v1/tenants")).json()["tenants"]
    assert {"default", "acme"} <= {t["id"] for t in listed}
    assert next(t for t in listed if t["id"] == "acme")["name"] == "Acme Inc."

    for body, field in (({"id": "a:b"}, "id"), ({"name": "x"}, "id"), ({"id": "ok", "n": 1}, "n")):
        refused = await http.post("/v1/tenants", json=body)
        assert refused.status_code == 400, refused.text
        assert field in _error(refused)["message"]

    admin = await _create_key(http, admin=True)
    plain = await _create_key(http)
    for key in (admin["key"], plain["key"]):
        async with stack.client(key) as client:
            assert (await client.get("/v1/tenants")).status_code == 403
            assert (await client.post("/v1/tenants", json={"id": "sneaky"})).status_code == 403
    names = {t["id"] for t in (await http.get("/v1/tenants")).json()["tenants"]}
    assert "sneaky" not in names


async def test_keys_by_operator_admin_and_plain_keys(stack: Stack) -> None:
    operator = stack.http
    await operator.post("/v1/tenants", json={"id": "acme"})
    acme_admin = await _create_key(operator, "acme", admin=True)
    assert acme_admin["tenant"] == "acme" and acme_admin["key"]
    default_plain = await _create_key(operator)
    operator_key = await _create_key(operator, "acme", operator=True)
    assert operator_key["operator"] is True

    async with stack.client(acme_admin["key"]) as acme:
        # A tenant's admin: its own tenant's keys, never operator keys.
        made = await _create_key(acme, admin=False)
        assert made["tenant"] == "acme"
        assert (await acme.post("/v1/keys", json={"operator": True})).status_code == 403
        other = await acme.post("/v1/keys", json={"tenant": "default"})
        assert other.status_code == 404, other.text
        listed = (await acme.get("/v1/keys")).json()["keys"]
        assert {k["tenant"] for k in listed} == {"acme"}
        assert made["id"] in {k["id"] for k in listed}
        assert all("key" not in k for k in listed)  # a key is shown once, at creation
        assert (await acme.get("/v1/keys", params={"tenant": "default"})).status_code == 404
        # Another tenant's key does not exist for it; nor may it revoke operators.
        assert (await acme.delete(f"/v1/keys/{default_plain['id']}")).status_code == 404
        assert (await acme.delete(f"/v1/keys/{operator_key['id']}")).status_code == 403

    everything = (await operator.get("/v1/keys")).json()["keys"]
    assert {"default", "acme"} <= {k["tenant"] for k in everything}
    only_acme = (await operator.get("/v1/keys", params={"tenant": "acme"})).json()["keys"]
    assert {k["tenant"] for k in only_acme} == {"acme"}
    assert (await operator.get("/v1/keys", params={"tenant": "nobody"})).status_code == 404
    assert (await operator.post("/v1/keys", json={"tenant": "nobody"})).status_code == 404
    assert (await operator.delete("/v1/keys/key_nosuchkey")).status_code == 404
    assert (await operator.post("/v1/keys", json={"admin": "yes"})).status_code == 400

    async with stack.client(default_plain["key"]) as plain:
        assert (await plain.get("/v1/keys")).status_code == 403
        assert (await plain.post("/v1/keys", json={})).status_code == 403
        assert (await plain.delete(f"/v1/keys/{default_plain['id']}")).status_code == 403


async def test_a_revoked_key_is_refused(stack: Stack) -> None:
    operator = stack.http
    created = await _create_key(operator, admin=True)
    async with stack.client(created["key"]) as client:
        # Used once: the edge now has it in its authentication cache.
        assert (await client.get("/v1/loadout")).status_code == 200
        revoked = await operator.delete(f"/v1/keys/{created['id']}")
        assert revoked.status_code == 200, revoked.text
        assert revoked.json() == {"id": created["id"], "revoked": True}

        async def refused() -> httpx.Response | None:
            response = await client.get("/v1/loadout")
            return response if response.status_code == 401 else None

        response = await eventually(refused, "the revoked key to be refused", 5)
        assert _error(response)["code"] == "unauthorized"
        assert (await client.post("/v1/sessions", json={})).status_code == 401
    again = await operator.delete(f"/v1/keys/{created['id']}")
    assert again.status_code == 200 and again.json()["revoked"] is False
    listed = (await operator.get("/v1/keys", params={"tenant": "default"})).json()["keys"]
    entry = next(k for k in listed if k["id"] == created["id"])
    assert entry["revokedAtMs"] is not None
