"""The OpenAPI document at /openapi.json is a valid OpenAPI 3.1 document, names
every route the edge serves, and says what the edge really answers: each real
response below, success or refusal, has a documented status, and its body is
valid against the documented schema (jsonschema, draft 2020-12, the dialect
of OpenAPI 3.1)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from starlette.routing import Route

from edge.app import create_app
from services.common.internal_auth import TOKEN_HEADER
from services.runner.server import RunnerServer
from tests.support.approvals import require_approval, until_waiting
from tests.support.edge_stack import Stack
from tests.support.polling import eventually

DOCUMENT_URI = "urn:keel:edge:openapi"
ADMIN_ONLY_KEY = "edge-test-admin-only-key-012345"
PLAIN_KEY = "edge-test-plain-key-0123456789"


def _pointer(*parts: str) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


class Conformance:
    """Checks real responses against the document; remembers which
    (path, method, status) it saw, so a test can tell what it left out."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        self.registry: Registry[Any] = Registry().with_resource(DOCUMENT_URI, resource)
        self.seen: set[tuple[str, str, int]] = set()

    def body_errors(self, path: str, method: str, status: int, body: Any) -> list[str]:
        """What is wrong with `body` as the JSON answer `status` of an operation."""
        pointer = _pointer(
            "paths", path, method, "responses", str(status), "content", "application/json"
        )
        validator = Draft202012Validator(
            {"$ref": f"{DOCUMENT_URI}#{pointer}/schema"}, registry=self.registry
        )
        return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]

    def check(self, path: str, response: httpx.Response, read_body: bool = True) -> None:
        method = response.request.method.lower()
        operation = self.document["paths"][path][method]
        status = response.status_code
        where = f"{method.upper()} {path} -> {status}"
        documented = operation["responses"].get(str(status))
        assert documented is not None, f"{where} is not documented: {response.text[:300]}"
        self.seen.add((path, method, status))
        for name, header in documented.get("headers", {}).items():
            if header.get("required"):
                assert name in response.headers, f"{where}: no {name} header"
        content = documented.get("content")
        if not content:
            assert not read_body or response.content == b"", f"{where}: undocumented body"
            return
        media = response.headers.get("content-type", "").split(";")[0].strip()
        key = media if media in content else "*/*"
        assert key in content, f"{where}: content type {media!r} is not documented"
        if not read_body or key != "application/json":
            return
        errors = self.body_errors(path, method, status, response.json())
        assert not errors, f"{where}: {errors} in {response.text[:300]}"


async def _document(stack: Stack) -> dict[str, Any]:
    anonymous = httpx.AsyncClient(base_url=stack.url)
    try:
        response = await anonymous.get("/openapi.json")
    finally:
        await anonymous.aclose()
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


async def test_the_document_is_valid_openapi(stack: Stack) -> None:
    document = await _document(stack)
    validate(document)
    # The upload routes share their path parameter (it once was missing).
    blob = document["paths"]["/v1/blobs/{id}"]
    assert {p["name"] for p in blob["parameters"]} == {"id"}
    assert {"get", "head", "patch"} <= set(blob)


async def test_every_route_is_documented_and_nothing_else(stack: Stack) -> None:
    document = await _document(stack)
    served: set[tuple[str, str]] = set()
    for route in create_app(stack.gateway).routes:
        if not isinstance(route, Route):
            continue  # the static files of the web page
        methods = route.methods or set()
        for method in methods:
            # Starlette answers HEAD wherever it answers GET; only a HEAD
            # with a meaning of its own is documented.
            if (
                method == "HEAD"
                and "GET" in methods
                and "head" not in document["paths"].get(route.path, {})
            ):
                continue
            served.add((route.path, method.lower()))
    verbs = {"get", "put", "post", "delete", "patch", "head", "options"}
    documented = {
        (path, method)
        for path, item in document["paths"].items()
        for method in item
        if method in verbs
    }
    assert served == documented


async def test_the_schemas_catch_a_wrong_field(stack: Stack) -> None:
    conformance = Conformance(await _document(stack))
    path = "/v1/sessions/{id}/inputs"
    good = {"seq": 3, "requestId": "r-1", "retrySafe": True}
    assert conformance.body_errors(path, "post", 202, good) == []
    for wrong in (
        {**good, "extra": 1},
        {"seq": 3, "requestId": "r-1"},
        {**good, "seq": "3"},
        {"seq": 3, "request_id": "r-1", "retrySafe": True},
    ):
        assert conformance.body_errors(path, "post", 202, wrong), wrong
    assert conformance.body_errors("/v1/sessions/{id}", "get", 200, {"error": "x"})


async def test_real_responses_conform_to_the_document(stack: Stack, runner: RunnerServer) -> None:
    conformance = Conformance(await _document(stack))
    check = conformance.check
    http = stack.http
    kernel = stack.cluster.kernel
    await kernel.create_api_key("default", ADMIN_ONLY_KEY, admin=True)
    await kernel.create_api_key("default", PLAIN_KEY)
    admin_only = stack.client(ADMIN_ONLY_KEY)
    plain = stack.client(PLAIN_KEY)
    anonymous = httpx.AsyncClient(base_url=stack.url, timeout=30)
    huge = json.dumps({"text": "x" * (1 << 20)}).encode()
    try:
        # -- sessions
        check("/v1/sessions", await http.post("/v1/sessions", json={}))
        check("/v1/sessions", await http.post("/v1/sessions", json={"id": "named-1"}))
        check("/v1/sessions", await http.post("/v1/sessions", json={"id": "named-1"}))  # 409
        check("/v1/sessions", await http.post("/v1/sessions", json={"id": 5}))
        check("/v1/sessions", await http.post("/v1/sessions", json={"nope": 1}))
        check("/v1/sessions", await http.post("/v1/sessions", content=huge))
        check("/v1/sessions", await anonymous.post("/v1/sessions", json={}))
        check("/v1/sessions", await http.get("/v1/sessions", params={"limit": "1"}))
        check("/v1/sessions", await http.get("/v1/sessions"))
        check("/v1/sessions", await http.get("/v1/sessions", params={"limit": "0"}))
        check("/v1/sessions", await anonymous.get("/v1/sessions"))

        session = await stack.new_session()
        one = "/v1/sessions/{id}"
        check(one, await http.get(f"/v1/sessions/{session}"))
        check(one, await http.get("/v1/sessions/no-such-session"))
        check(one, await http.get("/v1/sessions/a%20b"))

        # -- inputs
        inputs = "/v1/sessions/{id}/inputs"
        url = f"/v1/sessions/{session}/inputs"
        first = await http.post(url, json={"text": "hello", "requestId": "c-1"})
        check(inputs, first)
        check(inputs, await http.post(url, json={"text": "hello", "requestId": "c-1"}))
        check(inputs, await http.post(url, json={"text": "other", "requestId": "c-1"}))
        check(inputs, await http.post(url, json={"text": "made"}))
        check(inputs, await http.post(url, json={"txt": "typo"}))
        check(inputs, await http.post(url, json={"text": "x", "blobs": ["blob-nope"]}))
        check(inputs, await http.post(url, content=huge))
        check(inputs, await http.post("/v1/sessions/nope/inputs", json={"text": "x"}))

        # -- retry
        retry = "/v1/sessions/{id}/retry"
        url = f"/v1/sessions/{session}/retry"
        seq = first.json()["seq"]
        check(retry, await http.post(url, json={"seq": seq, "requestId": "r-1"}))
        check(retry, await http.post(url, json={"seq": seq, "requestId": "r-1"}))
        check(retry, await http.post(url, json={"seq": seq, "requestId": "c-1"}))
        check(retry, await http.post(url, json={"seq": "1"}))
        check(retry, await http.post("/v1/sessions/nope/retry", json={"seq": 1}))

        # -- cancel: an idle session, then one with a slow answer under way
        cancel = "/v1/sessions/{id}/cancel"
        idle = await stack.new_session()
        check(cancel, await http.post(f"/v1/sessions/{idle}/cancel"))
        await stack.post_input(idle, "/slow 30 a slow answer to cancel", "slow-1")
        check(cancel, await http.post(f"/v1/sessions/{idle}/cancel"))
        check(cancel, await http.post("/v1/sessions/nope/cancel"))

        # -- fork and edit
        fork = "/v1/sessions/{id}/fork"
        check(fork, await http.post(f"/v1/sessions/{session}/fork", json={"at": 1}))
        check(fork, await http.post(f"/v1/sessions/{session}/fork", json={"at": 10_000}))
        check(fork, await http.post(f"/v1/sessions/{session}/fork", json={"at": "1"}))
        check(fork, await http.post("/v1/sessions/nope/fork", json={"at": 1}))
        edit = "/v1/sessions/{id}/edit"
        url = f"/v1/sessions/{session}/edit"
        check(edit, await http.post(url, json={"seq": seq, "text": "edited"}))
        check(edit, await http.post(url, json={"seq": 1, "text": "not an input"}))
        check(edit, await http.post("/v1/sessions/nope/edit", json={"seq": 2, "text": "x"}))

        # -- schedules
        scheduled = "/v1/sessions/{id}/schedules"
        url = f"/v1/sessions/{session}/schedules"
        made = await http.post(url, json={"text": "tick", "cron": "0 9 * * 1", "timezone": "UTC"})
        check(scheduled, made)
        check(scheduled, await http.post(url, json={"text": "x", "cron": "every day"}))
        check(scheduled, await http.post(url, json={"text": "x", "at": "soon"}))
        check(scheduled, await http.post("/v1/sessions/nope/schedules", json={"text": "x"}))
        check(scheduled, await http.get(url))
        check(scheduled, await http.get("/v1/sessions/nope/schedules"))
        one_schedule = "/v1/sessions/{id}/schedules/{scheduleId}"
        check(one_schedule, await http.delete(f"{url}/{made.json()['id']}"))
        check(one_schedule, await http.delete(f"{url}/{made.json()['id']}"))

        # -- skip: a session parked by an input the model fails on
        skip = "/v1/sessions/{id}/skip"
        parked = await stack.new_session()
        await stack.post_input(parked, "/fail", "fail-1")

        async def parked_info() -> httpx.Response | None:
            got = await http.get(f"/v1/sessions/{parked}")
            return got if got.json()["status"] == "parked" else None

        check(one, await eventually(parked_info, "the session to be parked"))
        check(skip, await http.post(f"/v1/sessions/{parked}/skip"))  # 202
        check(skip, await http.post(f"/v1/sessions/{parked}/skip"))  # 409: nothing left
        check(skip, await http.post("/v1/sessions/nope/skip"))

        # -- approvals: a `counter` call waits for one
        await require_approval(kernel)
        waiting = await stack.new_session()
        await stack.post_input(waiting, '/tool counter {"key": "openapi"}', "approve-1")
        call_id = (await until_waiting(http, waiting))["pendingApprovals"][0]["toolCallId"]
        check(one, await http.get(f"/v1/sessions/{waiting}"))  # with its pending approval
        approvals = "/v1/sessions/{id}/approvals"
        url = f"/v1/sessions/{waiting}/approvals"
        check(approvals, await http.post(url, json={"toolCallId": call_id}))  # 400
        check(approvals, await http.post(url, json={"toolCallId": "c-9", "approve": True}))  # 409
        decided = await http.post(url, json={"toolCallId": call_id, "approve": True, "note": "ok"})
        check(approvals, decided)
        check(approvals, await http.post(url, json={"toolCallId": call_id, "approve": False}))
        check(approvals, await http.post(url, content=huge))
        check(approvals, await http.post("/v1/sessions/nope/approvals", json={}))

        # -- events: a page, a stream, refusals
        events = "/v1/sessions/{id}/events"
        url = f"/v1/sessions/{session}/events"
        check(events, await http.get(url, params={"format": "json"}))
        async with http.stream("GET", url, headers={"Accept": "text/event-stream"}) as stream:
            check(events, stream, read_body=False)
        check(events, await http.get(url, params={"format": "xml"}))
        check(events, await http.get(url, params={"after": "999"}))
        check(events, await http.get("/v1/sessions/nope/events"))

        # -- context
        context = "/v1/sessions/{id}/context"
        url = f"/v1/sessions/{session}/context"
        check(context, await http.get(url))
        check(context, await http.get(url, params={"at": "9999"}))
        check(context, await http.get("/v1/sessions/nope/context"))

        # -- blobs
        blobs = "/v1/blobs"
        created = await http.post(blobs, json={"length": 4, "contentType": "image/png"})
        check(blobs, created)
        check(blobs, await http.post(blobs, json={}))
        blob_id = created.json()["id"]
        blob, blob_url = "/v1/blobs/{id}", f"/v1/blobs/{blob_id}"
        content, content_url = "/v1/blobs/{id}/content", f"{blob_url}/content"
        check(blob, await http.patch(blob_url, content=b"ab", headers={"Upload-Offset": "0"}))
        check(content, await http.get(content_url))  # 409: half uploaded
        check(blob, await http.patch(blob_url, content=b"ab", headers={"Upload-Offset": "0"}))
        check(blob, await http.patch(blob_url, content=b"abcd", headers={"Upload-Offset": "2"}))
        check(blob, await http.patch(blob_url, content=b"cd"))
        check(blob, await http.patch(blob_url, content=b"cd", headers={"Upload-Offset": "2"}))
        check(blob, await http.get(blob_url))
        check(blob, await http.head(blob_url))
        check(blob, await http.head("/v1/blobs/blob-nope"))
        check(blob, await http.get("/v1/blobs/blob-nope"))
        check(
            blob, await http.patch("/v1/blobs/nope", content=b"x", headers={"Upload-Offset": "0"})
        )
        check(content, await http.get(content_url))
        check(content, await http.get("/v1/blobs/blob-nope/content"))

        # -- runtime: the stack's key is admin and operator
        status = "/v1/runtime/status"
        check(status, await http.get(status))
        check(status, await admin_only.get(status))
        check(status, await plain.get(status))
        drain = "/v1/runtime/drain"
        check(drain, await admin_only.post(drain, json={"mode": "handoff"}))
        check(drain, await http.post(drain, json={"mode": "now"}))
        # A runner that is not there is an error, and this edge keeps serving.
        check(drain, await http.post(drain, json={"runtimeId": "no-such-runner"}))  # 404
        # Every attached runner (here: none); the edge is not one of them.
        check(drain, await http.post(drain, json={"mode": "handoff", "deadlineMs": 1000}))
        undo = "/v1/runtime/drain/undo"
        check(undo, await http.post(undo, json={}))
        check(undo, await http.post(undo, json={"runtimeId": "no-such-runner"}))  # 404
        local = "/internal/v1/drain"
        check(local, await anonymous.post(local, json={"undo": True}))  # 401: no token
        token = {TOKEN_HEADER: stack.cluster.settings.internal_token}
        check(local, await anonymous.post(local, json={"undo": True}, headers=token))
        assert not stack.gateway.draining.is_set()

        # -- loadout, tenants and keys
        loadout = "/v1/loadout"
        check(loadout, await http.get(loadout))
        check(loadout, await plain.get(loadout))  # 403
        document = {"systemPrompt": "Be brief.", "model": {"provider": "scripted"}}
        stored = await http.put(loadout, json=document)
        check(loadout, stored)
        revision = stored.json()["revision"]
        check(loadout, await http.put(loadout, json={"model": {"provider": "nope"}}))
        check(loadout, await http.put(loadout, json=document, headers={"If-Match": "999"}))
        check(loadout, await http.put(loadout, content=huge))
        check(loadout, await plain.put(loadout, json=document))
        check(loadout, await http.put(loadout, json=document, headers={"If-Match": str(revision)}))
        tenants = "/v1/tenants"
        check(tenants, await http.get(tenants))
        check(tenants, await admin_only.get(tenants))  # 403
        check(tenants, await http.post(tenants, json={"id": "acme", "name": "Acme"}))
        check(tenants, await http.post(tenants, json={"id": "acme"}))  # 200: existed
        check(tenants, await http.post(tenants, json={"id": "a:b"}))
        check(tenants, await plain.post(tenants, json={"id": "other"}))
        keys = "/v1/keys"
        created = await http.post(keys, json={"tenant": "acme", "admin": True})
        check(keys, created)
        check(keys, await http.post(keys, json={"tenant": "nobody"}))
        check(keys, await http.post(keys, json={"admin": 1}))
        check(keys, await admin_only.post(keys, json={"operator": True}))
        check(keys, await http.get(keys))
        check(keys, await http.get(keys, params={"tenant": "nobody"}))
        check(keys, await plain.get(keys))
        one_key = "/v1/keys/{keyId}"
        check(one_key, await admin_only.delete(f"/v1/keys/{created.json()['id']}"))  # 404
        check(one_key, await plain.delete("/v1/keys/key_nope"))  # 403
        check(one_key, await http.delete(f"/v1/keys/{created.json()['id']}"))

        # -- what needs no key
        for path in ("/healthz", "/readyz", "/openapi.json", "/"):
            check(path, await anonymous.get(path))
        for path in ("/healthz", "/readyz", "/openapi.json"):
            check(path, await anonymous.get(path, params={"pageSize": "5"}))  # 400
        # -- metrics: an operator key's only
        check("/metrics", await http.get("/metrics"))
        check("/metrics", await anonymous.get("/metrics"))
        check("/metrics", await admin_only.get("/metrics"))
    finally:
        for client in (admin_only, plain, anonymous):
            await client.aclose()

    # Each operation was seen succeeding and, where it documents a client
    # error, refusing.
    missing = []
    for path, item in conformance.document["paths"].items():
        for method, operation in item.items():
            if method == "parameters":
                continue
            statuses = {s for p, m, s in conformance.seen if (p, m) == (path, method)}
            if not any(200 <= s < 300 for s in statuses):
                missing.append(f"{method.upper()} {path}: no success")
            client_errors = [c for c in operation["responses"] if c.startswith("4")]
            if client_errors and not any(400 <= s < 500 for s in statuses):
                missing.append(f"{method.upper()} {path}: no refusal")
    assert not missing, missing
