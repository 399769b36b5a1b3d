"""Resumable blob uploads and tenant isolation, over real HTTP (SPEC §7, §9)."""

from __future__ import annotations

import hashlib
import json
import random

import httpx

from tests.support.edge_stack import Stack
from tests.support.http_errors import assert_error

OTHER_KEY = "edge-test-tenant-b-key-0123456789"
PLAIN_KEY = "edge-test-default-plain-key-0123"


async def test_blob_upload_resumes_after_an_interrupted_chunk(stack: Stack) -> None:
    http = stack.http
    payload = random.Random(5).randbytes(300_000)
    created = await http.post(
        "/v1/blobs", json={"length": len(payload), "contentType": "application/pdf"}
    )
    assert created.status_code == 201, created.text
    blob = created.json()
    blob_id = blob["id"]
    assert blob["offset"] == 0 and blob["complete"] is False and blob["sha256"] is None
    assert created.headers["Upload-Offset"] == "0"

    first = await http.patch(
        f"/v1/blobs/{blob_id}", content=payload[:100_000], headers={"Upload-Offset": "0"}
    )
    assert first.status_code == 200, first.text
    assert first.headers["Upload-Offset"] == "100000"

    # The client lost track (e.g. the response to a second chunk never came)
    # and sends the next chunk at a wrong offset: refused, nothing appended.
    wrong = await http.patch(
        f"/v1/blobs/{blob_id}",
        content=payload[150_000:250_000],
        headers={"Upload-Offset": "150000"},
    )
    assert_error(wrong, 409)
    assert "100000" in wrong.json()["error"]["message"]
    # Going back (a retransmitted first chunk) is refused too.
    again = await http.patch(
        f"/v1/blobs/{blob_id}", content=payload[:100_000], headers={"Upload-Offset": "0"}
    )
    assert_error(again, 409)

    head = await http.head(f"/v1/blobs/{blob_id}")
    assert head.status_code == 200
    assert head.headers["Upload-Offset"] == "100000"
    assert head.headers["Upload-Length"] == str(len(payload))

    # An input cannot reference the incomplete blob.
    session = await stack.new_session()
    early = await stack.http.post(
        f"/v1/sessions/{session}/inputs",
        json={"text": "read this", "requestId": "early", "blobs": [blob_id]},
    )
    assert_error(early, 400)

    # A chunk going past the declared length is refused.
    too_long = await http.patch(
        f"/v1/blobs/{blob_id}",
        content=payload[100_000:] + b"extra",
        headers={"Upload-Offset": "100000"},
    )
    assert too_long.status_code == 413, too_long.text

    offset = int(head.headers["Upload-Offset"])
    while offset < len(payload):
        chunk = payload[offset : offset + 64_000]
        step = await http.patch(
            f"/v1/blobs/{blob_id}", content=chunk, headers={"Upload-Offset": str(offset)}
        )
        assert step.status_code == 200, step.text
        offset = int(step.headers["Upload-Offset"])
    done = step.json()
    assert done["complete"] is True
    assert done["offset"] == len(payload)
    assert done["sha256"] == hashlib.sha256(payload).hexdigest()
    info = (await http.get(f"/v1/blobs/{blob_id}")).json()
    assert info["sha256"] == hashlib.sha256(payload).hexdigest()
    assert info["contentType"] == "application/pdf"

    # A complete blob: no more bytes, and inputs may reference it.
    extra = await http.patch(
        f"/v1/blobs/{blob_id}", content=b"x", headers={"Upload-Offset": str(len(payload))}
    )
    assert extra.status_code == 413
    accepted = await stack.http.post(
        f"/v1/sessions/{session}/inputs",
        json={"text": "read this", "requestId": "with-blob", "blobs": [blob_id]},
    )
    assert accepted.status_code == 202, accepted.text
    facts = await stack.facts(session)
    assert facts[-1].kind == "input" and facts[-1].data["blobs"] == [blob_id]

    missing_offset = await http.patch(f"/v1/blobs/{blob_id}", content=b"x")
    assert_error(missing_offset, 400)
    bad_offset = await http.patch(
        f"/v1/blobs/{blob_id}", content=b"x", headers={"Upload-Offset": "-3"}
    )
    assert_error(bad_offset, 400)


async def test_tenants_are_isolated(stack: Stack) -> None:
    kernel = stack.cluster.kernel
    await kernel.create_tenant("tenant-b", "Tenant B")
    await kernel.create_api_key("tenant-b", OTHER_KEY)
    await kernel.create_api_key("default", PLAIN_KEY)

    session = await stack.new_session()
    posted = await stack.post_input(session, "secret", "secret-1")
    assert posted.status_code == 202
    blob = (await stack.http.post("/v1/blobs", json={"length": 3})).json()["id"]

    other = httpx.AsyncClient(
        base_url=stack.url, headers={"Authorization": f"Bearer {OTHER_KEY}"}, timeout=30
    )
    plain = httpx.AsyncClient(
        base_url=stack.url, headers={"Authorization": f"Bearer {PLAIN_KEY}"}, timeout=30
    )
    anonymous = httpx.AsyncClient(base_url=stack.url, timeout=30)
    try:
        # Tenant B sees nothing of the default tenant's session: 404, as if absent.
        refusals = {
            "get": await other.get(f"/v1/sessions/{session}"),
            "input": await other.post(
                f"/v1/sessions/{session}/inputs", json={"text": "x", "requestId": "b-1"}
            ),
            "events": await other.get(f"/v1/sessions/{session}/events"),
            "events page": await other.get(f"/v1/sessions/{session}/events?format=json"),
            "context": await other.get(f"/v1/sessions/{session}/context"),
            "cancel": await other.post(f"/v1/sessions/{session}/cancel"),
            "retry": await other.post(f"/v1/sessions/{session}/retry", json={"seq": 1}),
            "blob": await other.get(f"/v1/blobs/{blob}"),
            "blob patch": await other.patch(
                f"/v1/blobs/{blob}", content=b"abc", headers={"Upload-Offset": "0"}
            ),
        }
        for name, response in refusals.items():
            assert response.status_code == 404, (name, response.status_code, response.text)
        for name in ("get", "input", "events", "cancel", "retry"):
            assert "secret" not in refusals[name].text
        # Session ids are per tenant: B may use the same id, which names B's
        # own, empty session (creating it reveals nothing of the default one).
        own = await other.post("/v1/sessions", json={"id": session})
        assert own.status_code == 201, own.text
        own_id = own.json()["id"]
        assert own_id == session
        again = await other.post("/v1/sessions", json={"id": session})
        assert_error(again, 409)
        mine = (await other.get(f"/v1/sessions/{own_id}")).json()
        assert mine["id"] == session and mine["owedInputs"] == []
        page = (await other.get(f"/v1/sessions/{own_id}/events?format=json")).json()
        assert "secret" not in json.dumps(page)
        assert [f["kind"] for f in page["facts"]] == ["session_created"]
        # Its own list does not show the other tenant's session; its own does.
        listed = [s["id"] for s in (await other.get("/v1/sessions")).json()["sessions"]]
        assert listed == [own_id]
        default_listed = [
            s["id"] for s in (await stack.http.get("/v1/sessions")).json()["sessions"]
        ]
        assert default_listed.count(session) == 1
        # And the default tenant cannot reach tenant B's sessions either.
        b_only = (await other.post("/v1/sessions", json={})).json()["id"]
        assert (await stack.http.get(f"/v1/sessions/{b_only}")).status_code == 404
        assert b_only not in [
            s["id"] for s in (await stack.http.get("/v1/sessions")).json()["sessions"]
        ]

        # Nothing reached the ledger from tenant B's refused calls.
        facts = await stack.facts(session)
        assert [f.data["requestId"] for f in facts if f.kind == "input"] == ["secret-1"]
        assert not [f for f in facts if f.kind == "cancelled"]

        # A non-admin key: 403 on the runtime endpoints; fine on its sessions.
        for response in (
            await plain.get("/v1/runtime/status"),
            await plain.post("/v1/runtime/drain", json={"mode": "handoff"}),
            await other.get("/v1/runtime/status"),
        ):
            assert_error(response, 403)
        assert (await plain.get(f"/v1/sessions/{session}")).status_code == 200
        assert not stack.gateway.draining.is_set()

        # No key, or an unknown key: 401.
        for response in (
            await anonymous.get("/v1/sessions"),
            await anonymous.post("/v1/sessions", json={}),
            await anonymous.get(f"/v1/sessions/{session}/events"),
            await anonymous.get("/v1/runtime/status"),
            await anonymous.get("/v1/sessions", headers={"Authorization": "Bearer not-a-real-key"}),
            await anonymous.get("/v1/sessions", headers={"Authorization": "Basic abc"}),
        ):
            assert_error(response, 401)
        # The admin key of the default tenant reaches the runtime endpoints.
        assert (await stack.http.get("/v1/runtime/status")).status_code == 200
    finally:
        for client in (other, plain, anonymous):
            await client.aclose()


async def test_a_complete_blob_downloads_with_its_content_type(stack: Stack) -> None:
    http = stack.http
    payload = random.Random(7).randbytes(70_000)
    content_type = "text/plain; charset=latin-1"
    blob_id = (
        await http.post("/v1/blobs", json={"length": len(payload), "contentType": content_type})
    ).json()["id"]
    half = len(payload) // 2
    first = await http.patch(
        f"/v1/blobs/{blob_id}", content=payload[:half], headers={"Upload-Offset": "0"}
    )
    assert first.status_code == 200, first.text

    # Half uploaded: nothing to download yet.
    early = await http.get(f"/v1/blobs/{blob_id}/content")
    assert str(half) in assert_error(early, 409)["message"]

    rest = await http.patch(
        f"/v1/blobs/{blob_id}", content=payload[half:], headers={"Upload-Offset": str(half)}
    )
    assert rest.json()["complete"] is True
    download = await http.get(f"/v1/blobs/{blob_id}/content")
    assert download.status_code == 200
    assert download.content == payload
    assert download.headers["content-type"] == content_type
    assert download.headers["x-content-type-options"] == "nosniff"

    kernel = stack.cluster.kernel
    await kernel.create_tenant("tenant-b", "Tenant B")
    await kernel.create_api_key("tenant-b", OTHER_KEY)
    other = stack.client(OTHER_KEY)
    try:
        assert_error(await other.get(f"/v1/blobs/{blob_id}/content"), 404)
    finally:
        await other.aclose()
    for missing in ("blob-" + "0" * 24, "blob-not-made-by-the-store", "x" * 500):
        assert_error(await http.get(f"/v1/blobs/{missing}/content"), 404)
