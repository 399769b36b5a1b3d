"""The edge's HTTP API over real HTTP (SPEC §7): idempotent inputs, errors
that are JSON 4xx and never 5xx, probes, metrics and the OpenAPI document."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator

import httpx

from tests.support.edge_stack import Stack
from tests.support.http_errors import assert_error


async def _chunks(count: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield b"x" * size


async def test_inputs_are_idempotent_by_request_id(stack: Stack) -> None:
    session = await stack.new_session()

    first = await stack.post_input(session, "hello", "req-1")
    assert first.status_code == 202, first.text
    seq = first.json()["seq"]
    assert isinstance(seq, int) and seq >= 1

    assert first.json() == {"seq": seq, "requestId": "req-1", "retrySafe": True}

    again = await stack.post_input(session, "hello", "req-1")
    assert again.status_code == 200, again.text
    assert again.json() == {"seq": seq, "requestId": "req-1", "retrySafe": True}

    other = await stack.post_input(session, "another body", "req-1")
    error = assert_error(other, 409)
    assert error["code"] == "conflict"

    second = await stack.post_input(session, "hello", "req-2")
    assert second.status_code == 202
    assert second.json()["seq"] == seq + 1

    # The ledger holds each input once, the conflicting body never.
    facts = await stack.facts(session)
    inputs = [f for f in facts if f.kind == "input"]
    assert [(f.seq, f.data["requestId"], f.data["text"]) for f in inputs] == [
        (seq, "req-1", "hello"),
        (seq + 1, "req-2", "hello"),
    ]
    view = (await stack.http.get(f"/v1/sessions/{session}")).json()
    assert view["id"] == session and view["headSeq"] == facts[-1].seq
    assert view["owedInputs"] == [seq, seq + 1]


async def test_bad_requests_are_json_4xx_never_5xx(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session()
    inputs = f"/v1/sessions/{session}/inputs"
    json_headers = {"Content-Type": "application/json"}

    cases: list[tuple[str, httpx.Response, int]] = [
        (
            "malformed JSON",
            await http.post(inputs, content=b"{not json", headers=json_headers),
            400,
        ),
        ("invalid UTF-8", await http.post(inputs, content=b'{"text":"\xff"}'), 400),
        ("JSON array", await http.post(inputs, json=["text", "requestId"]), 400),
        ("JSON string", await http.post(inputs, json="hello"), 400),
        ("JSON null", await http.post(inputs, content=b"null"), 400),
        ("empty body", await http.post(inputs, content=b""), 400),
        ("missing text", await http.post(inputs, json={"requestId": "r"}), 400),
        ("text not a string", await http.post(inputs, json={"text": 5, "requestId": "r"}), 400),
        (
            "requestId not a string",
            await http.post(inputs, json={"text": "x", "requestId": ["r"]}),
            400,
        ),
        (
            "blobs not a list",
            await http.post(inputs, json={"text": "x", "requestId": "r", "blobs": "b"}),
            400,
        ),
        (
            "unknown blob",
            await http.post(
                inputs, json={"text": "x", "requestId": "r", "blobs": ["blob-" + "0" * 24]}
            ),
            404,
        ),
        (
            "not a blob id",
            await http.post(inputs, json={"text": "x", "requestId": "r", "blobs": ["blob-nope"]}),
            400,
        ),
        (
            "huge body",
            await http.post(
                inputs,
                content=json.dumps({"text": "x" * (1 << 20), "requestId": "big"}).encode(),
                headers=json_headers,
            ),
            413,
        ),
        ("session id not a string", await http.post("/v1/sessions", json={"id": 7}), 400),
        ("bad session id chars", await http.post("/v1/sessions", json={"id": "a b/c"}), 400),
        # ':' separates tenant and id in the ledger: never part of a client's id.
        ("colon in session id", await http.post("/v1/sessions", json={"id": "x:y"}), 400),
        ("colon in a path id", await http.get("/v1/sessions/default:x"), 400),
        ("duplicate session id", await http.post("/v1/sessions", json={"id": session}), 409),
        ("unknown session", await http.get("/v1/sessions/no-such-session"), 404),
        (
            "input to unknown session",
            await http.post(
                "/v1/sessions/no-such-session/inputs", json={"text": "x", "requestId": "r"}
            ),
            404,
        ),
        ("events of unknown session", await http.get("/v1/sessions/no-such-session/events"), 404),
        ("bad session id chars in path", await http.get("/v1/sessions/a%20b%2A"), 400),
        ("bad session id in events path", await http.get("/v1/sessions/%24%24/events"), 400),
        (
            "Last-Event-ID not a number",
            await http.get(f"/v1/sessions/{session}/events", headers={"Last-Event-ID": "abc"}),
            400,
        ),
        (
            "Last-Event-ID negative",
            await http.get(f"/v1/sessions/{session}/events", headers={"Last-Event-ID": "-1"}),
            400,
        ),
        ("after=-1", await http.get(f"/v1/sessions/{session}/events?after=-1"), 400),
        ("after=abc", await http.get(f"/v1/sessions/{session}/events?after=abc"), 400),
        (
            "limit=0",
            await http.get(f"/v1/sessions/{session}/events?format=json&limit=0"),
            400,
        ),
        ("context at=abc", await http.get(f"/v1/sessions/{session}/context?at=abc"), 400),
        ("retry without seq", await http.post(f"/v1/sessions/{session}/retry", json={}), 400),
        (
            "retry of a non-input",
            await http.post(f"/v1/sessions/{session}/retry", json={"seq": 99}),
            400,
        ),
        (
            "retry seq wrong type",
            await http.post(f"/v1/sessions/{session}/retry", json={"seq": "1"}),
            400,
        ),
        (
            "Last-Event-ID (superscript two) (isdigit, not int)",
            await http.get(
                f"/v1/sessions/{session}/events",
                headers={b"Last-Event-ID": "\u00b2".encode("latin-1")},
            ),
            400,
        ),
        (
            "Last-Event-ID past int64",
            await http.get(f"/v1/sessions/{session}/events", headers={"Last-Event-ID": "9" * 30}),
            400,
        ),
        (
            "after past int64",
            await http.get(f"/v1/sessions/{session}/events?after={'9' * 30}"),
            400,
        ),
        (
            "page after past int64",
            await http.get(f"/v1/sessions/{session}/events?format=json&after={'9' * 30}"),
            400,
        ),
        (
            "context at past int64",
            await http.get(f"/v1/sessions/{session}/context?at={'9' * 30}"),
            400,
        ),
        (
            "retry seq past int64",
            await http.post(f"/v1/sessions/{session}/retry", json={"seq": 10**30}),
            400,
        ),
        (
            "lone surrogate",
            await http.post(inputs, content=b'{"text": "\\ud800", "requestId": "s"}'),
            400,
        ),
        (
            "deeply nested JSON",
            await http.post(inputs, content=b"[" * 100_000 + b"]" * 100_000),
            400,
        ),
        (
            "huge chunked body (no Content-Length)",
            await http.post(inputs, content=_chunks(20, 100_000)),
            413,
        ),
        (
            "drain deadline past int64",
            await http.post("/v1/runtime/drain", json={"mode": "handoff", "deadlineMs": 10**30}),
            400,
        ),
        (
            "blob: Upload-Offset (superscript two)",
            await http.patch(
                "/v1/blobs/blob-nope",
                content=b"x",
                headers={b"Upload-Offset": "\u00b2".encode("latin-1")},
            ),
            400,
        ),
        ("unknown route", await http.get("/v1/nope"), 404),
        ("unknown nested route", await http.get(f"/v1/sessions/{session}/nope"), 404),
        ("wrong method on sessions", await http.delete("/v1/sessions"), 405),
        ("wrong method on inputs", await http.get(inputs), 405),
        ("wrong method on drain", await http.get("/v1/runtime/drain"), 405),
        ("drain: bad mode", await http.post("/v1/runtime/drain", json={"mode": "now"}), 400),
        (
            "drain: bad deadline",
            await http.post("/v1/runtime/drain", json={"mode": "handoff", "deadlineMs": "soon"}),
            400,
        ),
        ("blob: no length", await http.post("/v1/blobs", json={}), 400),
        ("blob: length not int", await http.post("/v1/blobs", json={"length": "9"}), 400),
        ("blob: length bool", await http.post("/v1/blobs", json={"length": True}), 400),
        ("blob: length zero", await http.post("/v1/blobs", json={"length": 0}), 400),
        ("blob: negative length", await http.post("/v1/blobs", json={"length": -5}), 400),
        ("blob: unknown", await http.head("/v1/blobs/blob-nope"), 404),
        ("blob: content of unknown", await http.get("/v1/blobs/blob-nope/content"), 404),
        (
            "blob: content type that could split a header",
            await http.post("/v1/blobs", json={"length": 3, "contentType": "text/plain\r\nX: y"}),
            400,
        ),
        (
            "blob: content type not a type",
            await http.post("/v1/blobs", json={"length": 3, "contentType": "png"}),
            400,
        ),
        (
            "events: unknown format",
            await http.get(f"/v1/sessions/{session}/events?format=xml"),
            400,
        ),
        ("sessions: limit=0", await http.get("/v1/sessions?limit=0"), 400),
        ("sessions: limit=abc", await http.get("/v1/sessions?limit=abc"), 400),
        ("sessions: after not an id", await http.get("/v1/sessions?after=a%20b"), 400),
        (
            "requestId and Idempotency-Key differ",
            await http.post(
                inputs, json={"text": "x", "requestId": "r-1"}, headers={"Idempotency-Key": "r-2"}
            ),
            400,
        ),
        (
            "Idempotency-Key not an id",
            await http.post(inputs, json={"text": "x"}, headers={"Idempotency-Key": "a b"}),
            400,
        ),
        (
            "empty Idempotency-Key",
            await http.post(inputs, json={"text": "x"}, headers={"Idempotency-Key": ""}),
            400,
        ),
        ("requestId empty", await http.post(inputs, json={"text": "x", "requestId": ""}), 400),
        (
            "retry: requestId not a string",
            await http.post(f"/v1/sessions/{session}/retry", json={"seq": 1, "requestId": 5}),
            400,
        ),
        (
            "blob: PATCH unknown",
            await http.patch("/v1/blobs/blob-nope", content=b"x", headers={"Upload-Offset": "0"}),
            404,
        ),
    ]
    failures = []
    for name, response, status in cases:
        if response.status_code != status:
            failures.append(f"{name}: {response.status_code} {response.text[:200]}")
            continue
        if response.request.method != "HEAD":
            try:
                assert_error(response, status)
            except (AssertionError, KeyError, ValueError) as error:
                failures.append(f"{name}: not a JSON error ({error!r}): {response.text[:200]}")
    assert not failures, "\n".join(failures)

    # Nothing of the refused inputs reached the ledger.
    assert [f for f in await stack.facts(session) if f.kind == "input"] == []
    # A wrong method says which are right.
    assert (await http.get(inputs)).headers["allow"] == "POST"


async def test_probes_metrics_and_openapi(stack: Stack) -> None:
    anonymous = httpx.AsyncClient(base_url=stack.url)
    try:
        assert (await anonymous.get("/healthz")).status_code == 200
        ready = await anonymous.get("/readyz")
        assert ready.status_code == 200, ready.text

        document = (await anonymous.get("/openapi.json")).json()
        assert str(document["openapi"]).startswith("3.")
        for path in ("/v1/sessions", "/v1/sessions/{id}/inputs", "/v1/sessions/{id}/events"):
            assert path in document["paths"], path

        session = await stack.new_session()
        # Refusals are counted too, whoever answered them: a handler of the
        # route's error, or the router itself.
        refused = await stack.http.post(f"/v1/sessions/{session}/inputs", json={"txt": "x"})
        assert refused.status_code == 400
        assert (await stack.http.get("/v1/nope")).status_code == 404
        # Metrics are the operator's: the stack's key is an operator key.
        assert (await anonymous.get("/metrics")).status_code == 401
        metrics = await stack.http.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        text = metrics.text
        assert "# TYPE keel_edge_requests_total counter" in text
        assert 'keel_edge_requests_total{route="create_session",status="201"} 1.0' in text
        assert 'keel_edge_requests_total{route="post_input",status="400"} 1.0' in text
        assert 'keel_edge_requests_total{route="unmatched",status="404"} 1.0' in text
        assert "keel_edge_sse_clients" in text

        page = await anonymous.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
    finally:
        await anonymous.aclose()


async def test_responses_are_not_held_back_by_nagle(stack: Stack) -> None:
    """Every accepted HTTP connection has TCP_NODELAY.

    Without it a response written in two parts (head, then body) waits for
    the client's delayed ACK, about 40 ms, on every keep-alive request: that
    was most of an input's latency before the edge named the TCP protocol on
    its listening socket.
    """
    response = await stack.http.get("/openapi.json")  # keeps its connection open
    assert response.status_code == 200
    server = stack.edge._server
    assert server is not None
    transports = [connection.transport for connection in server.server_state.connections]
    assert transports, "the client's keep-alive connection should still be open"
    for transport in transports:
        sock = transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_unknown_fields_are_refused_by_name(stack: Stack) -> None:
    """A misspelt field is a 400 naming it, not silently ignored: a
    `requestID` dropped on the floor would make a resend commit twice."""
    http = stack.http
    session = await stack.new_session()
    cases = {
        "requestID": await http.post(
            f"/v1/sessions/{session}/inputs", json={"text": "x", "requestID": "r-1"}
        ),
        "blob": await http.post(f"/v1/sessions/{session}/retry", json={"seq": 1, "blob": ["b"]}),
        "name": await http.post("/v1/sessions", json={"name": "mine"}),
        "size": await http.post("/v1/blobs", json={"length": 3, "size": 3}),
        "deadline": await http.post("/v1/runtime/drain", json={"mode": "handoff", "deadline": 5}),
    }
    for field_name, response in cases.items():
        error = assert_error(response, 400)
        assert repr(field_name) in error["message"], (field_name, error)
    # Nothing was committed, created or drained.
    assert [f.kind for f in await stack.facts(session)] == ["session_created"]
    listed = (await http.get("/v1/sessions")).json()["sessions"]
    assert [s["id"] for s in listed] == [session]
    assert not stack.gateway.draining.is_set()


async def test_a_400_never_echoes_a_long_client_value(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session()
    long = "z" * 5000
    responses = {
        "path session id": await http.get(f"/v1/sessions/{long}%20"),
        "created session id": await http.post("/v1/sessions", json={"id": long}),
        "requestId": await http.post(
            f"/v1/sessions/{session}/inputs", json={"text": "x", "requestId": long}
        ),
        "Idempotency-Key": await http.post(
            f"/v1/sessions/{session}/inputs", json={"text": "x"}, headers={"Idempotency-Key": long}
        ),
        "retry requestId": await http.post(
            f"/v1/sessions/{session}/retry", json={"seq": 1, "requestId": long}
        ),
        "unknown field": await http.post(f"/v1/sessions/{session}/inputs", json={long: 1}),
        "list cursor": await http.get(f"/v1/sessions?after={long}"),
    }
    for name, response in responses.items():
        message = assert_error(response, 400)["message"]
        assert "z" * 65 not in message, (name, message)
        assert "zzzz" in message, (name, "the refused value is still named, cut short")
