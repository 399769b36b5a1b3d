"""Inputs, retries, cancels and session listing over real HTTP (SPEC §7): the
requestId may come from the body or the Idempotency-Key header or be made by
the edge; a retry is deduplicated like an input and keeps the original's
blobs; a cancel of an idle session commits nothing; the session list pages."""

from __future__ import annotations

from typing import Any

from tests.support.edge_stack import Stack
from tests.support.http_errors import assert_error


async def _inputs(stack: Stack, session: str) -> list[tuple[int, dict[str, Any]]]:
    return [(f.seq, f.data) for f in await stack.facts(session) if f.kind == "input"]


async def _upload(stack: Stack, payload: bytes, content_type: str) -> str:
    created = await stack.http.post(
        "/v1/blobs", json={"length": len(payload), "contentType": content_type}
    )
    assert created.status_code == 201, created.text
    blob_id: str = created.json()["id"]
    done = await stack.http.patch(
        f"/v1/blobs/{blob_id}", content=payload, headers={"Upload-Offset": "0"}
    )
    assert done.status_code == 200 and done.json()["complete"] is True, done.text
    return blob_id


async def test_the_request_id_comes_from_the_body_the_header_or_the_edge(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session()
    inputs = f"/v1/sessions/{session}/inputs"

    # The Idempotency-Key header is the requestId: a resend is the same input.
    first = await http.post(inputs, json={"text": "hi"}, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 202, first.text
    seq = first.json()["seq"]
    assert first.json() == {"seq": seq, "requestId": "k-1", "retrySafe": True}
    resent = await http.post(inputs, json={"text": "hi"}, headers={"Idempotency-Key": "k-1"})
    assert resent.status_code == 200 and resent.json()["seq"] == seq
    # The same key in the body names the same input; both, equal, are fine.
    in_body = await http.post(inputs, json={"text": "hi", "requestId": "k-1"})
    assert in_body.status_code == 200 and in_body.json()["seq"] == seq
    both = await http.post(
        inputs, json={"text": "hi", "requestId": "k-1"}, headers={"Idempotency-Key": "k-1"}
    )
    assert both.status_code == 200 and both.json()["seq"] == seq
    # Another body under the key is a conflict, by header as by body.
    assert_error(
        await http.post(inputs, json={"text": "bye"}, headers={"Idempotency-Key": "k-1"}), 409
    )
    # Body and header that disagree: which one did the client mean? Refused.
    differ = await http.post(
        inputs, json={"text": "hi", "requestId": "k-2"}, headers={"Idempotency-Key": "k-3"}
    )
    assert "Idempotency-Key" in assert_error(differ, 400)["message"]

    # Neither: the edge makes an id, and says the input is not retry-safe;
    # sending the same text again is a second input.
    made = [await http.post(inputs, json={"text": "again"}) for _ in range(2)]
    for response in made:
        assert response.status_code == 202, response.text
        assert response.json()["retrySafe"] is False
    made_ids = [r.json()["requestId"] for r in made]
    assert made_ids[0] != made_ids[1]

    assert await _inputs(stack, session) == [
        (seq, {"text": "hi", "requestId": "k-1"}),
        (made[0].json()["seq"], {"text": "again", "requestId": made_ids[0]}),
        (made[1].json()["seq"], {"text": "again", "requestId": made_ids[1]}),
    ]


async def test_a_retry_is_deduplicated_and_keeps_the_blobs(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session()
    blob = await _upload(stack, b"\x89PNG fake image bytes", "image/png")
    original = await http.post(
        f"/v1/sessions/{session}/inputs",
        json={"text": "what is this?", "requestId": "ask-1", "blobs": [blob]},
    )
    assert original.status_code == 202, original.text
    asked = original.json()["seq"]
    plain = await stack.post_input(session, "and this?", "ask-2")
    plain_seq = plain.json()["seq"]
    retry = f"/v1/sessions/{session}/retry"

    first = await http.post(retry, json={"seq": asked, "requestId": "again-1"})
    assert first.status_code == 202, first.text
    retried = first.json()["seq"]
    assert first.json() == {"seq": retried, "requestId": "again-1", "retrySafe": True}
    # The same retry sent again (a lost response) is the same input.
    resent = await http.post(retry, json={"seq": asked, "requestId": "again-1"})
    assert resent.status_code == 200, resent.text
    assert resent.json()["seq"] == retried
    by_header = await http.post(retry, json={"seq": asked}, headers={"Idempotency-Key": "again-1"})
    assert by_header.status_code == 200 and by_header.json()["seq"] == retried
    # The key re-used to retry another input, or as an input's key: conflicts.
    assert_error(await http.post(retry, json={"seq": plain_seq, "requestId": "again-1"}), 409)
    assert_error(await stack.post_input(session, "what is this?", "again-1"), 409)
    # Without a key the edge makes one: each call is a new retry.
    unkeyed = await http.post(retry, json={"seq": plain_seq})
    assert unkeyed.status_code == 202 and unkeyed.json()["retrySafe"] is False

    inputs = dict(await _inputs(stack, session))
    assert inputs[retried] == {
        "text": "what is this?",
        "requestId": "again-1",
        "retryOf": asked,
        "blobs": [blob],
    }
    made = unkeyed.json()
    assert inputs[made["seq"]] == {
        "text": "and this?",
        "requestId": made["requestId"],
        "retryOf": plain_seq,
    }
    assert sorted(inputs) == [asked, plain_seq, retried, made["seq"]]


async def test_cancel_commits_only_when_there_is_something_to_cancel(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session()

    idle = await http.post(f"/v1/sessions/{session}/cancel")
    assert idle.status_code == 200, idle.text
    assert idle.json() == {"cancelled": False}
    assert [f.kind for f in await stack.facts(session)] == ["session_created"]

    # An owed input (no runner here to answer it) is something to cancel.
    posted = await stack.post_input(session, "never mind", "c-1")
    assert posted.status_code == 202
    owed = await http.post(f"/v1/sessions/{session}/cancel", json={})
    assert owed.status_code == 202, owed.text
    body = owed.json()
    assert body["cancelled"] is True
    facts = await stack.facts(session)
    assert (facts[-1].seq, facts[-1].kind) == (body["seq"], "cancelled")


async def test_sessions_are_listed_a_page_at_a_time(stack: Stack) -> None:
    http = stack.http
    ids = sorted(f"s-{i:03d}" for i in range(105))
    for session_id in ids:
        await stack.cluster.ledger.create_session(stack.ledger_id(session_id), "default")

    default_page = (await http.get("/v1/sessions")).json()
    assert [s["id"] for s in default_page["sessions"]] == ids[:100]
    assert default_page["next"] == ids[99]

    seen: list[str] = []
    after: str | None = None
    while True:
        params = {"limit": "40", **({"after": after} if after else {})}
        response = await http.get("/v1/sessions", params=params)
        assert response.status_code == 200, response.text
        page = response.json()
        assert len(page["sessions"]) <= 40
        seen += [s["id"] for s in page["sessions"]]
        after = page["next"]
        if after is None:
            break
    assert seen == ids

    # Exactly a page's worth left: the last page says so (no empty page after).
    last = (await http.get("/v1/sessions", params={"after": ids[99], "limit": "5"})).json()
    assert [s["id"] for s in last["sessions"]] == ids[100:]
    assert last["next"] is None
    # More than the maximum counts as the maximum.
    everything = (await http.get("/v1/sessions", params={"limit": "100000"})).json()
    assert [s["id"] for s in everything["sessions"]] == ids and everything["next"] is None
