"""One rule for the Content-Type of every JSON body.

Reproduced: `PUT /v1/loadout` refused `curl -d` (which sends
application/x-www-form-urlencoded) while input POSTs took any type at all,
YAML included. Now every route reading JSON reads it without a Content-Type,
with a JSON one, or with what curl -d and fetch() send when told nothing; any
other type is a 415 naming it, and nothing is done.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from tests.support.edge_stack import Stack

READ_AS_JSON = (
    None,
    "application/json",
    "application/json; charset=utf-8",
    "application/merge-patch+json",
    "application/x-www-form-urlencoded",  # curl -d
    "text/plain;charset=UTF-8",  # fetch() with a string body
)
NOT_JSON = ("application/yaml", "multipart/form-data; boundary=x", "application/octet-stream")


async def _send(
    http: httpx.AsyncClient, method: str, path: str, body: Any, media: str | None
) -> httpx.Response:
    # Raw bytes: httpx adds no Content-Type of its own.
    headers = {"Content-Type": media} if media is not None else {}
    request = http.build_request(method, path, content=json.dumps(body).encode(), headers=headers)
    assert request.headers.get("content-type") == media
    return await http.send(request)


async def test_every_json_body_follows_one_content_type_rule(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session("content-types")
    routes: list[tuple[str, str, Callable[[int], dict[str, str]]]] = [
        ("PUT", "/v1/loadout", lambda i: {"systemPrompt": f"prompt {i}"}),
        ("POST", f"/v1/sessions/{session}/inputs", lambda i: {"text": "hi", "requestId": f"r{i}"}),
        ("POST", "/v1/sessions", lambda i: {"id": f"made-{i}"}),
    ]
    for method, path, body in routes:
        for index, media in enumerate(READ_AS_JSON):
            response = await _send(http, method, path, body(index), media)
            assert response.status_code < 300, (method, path, media, response.text)
        before = (await http.get("/v1/loadout")).json()["revision"]
        for index, media in enumerate(NOT_JSON, start=len(READ_AS_JSON)):
            response = await _send(http, method, path, body(index), media)
            assert response.status_code == 415, (method, path, media, response.text)
            error = response.json()["error"]
            assert error["code"] == "unsupported_media_type", error
            assert media.split(";")[0] in error["message"], error
        assert (await http.get("/v1/loadout")).json()["revision"] == before
    # Nothing refused was done.
    inputs = [f for f in await stack.facts(session) if f.kind == "input"]
    assert len(inputs) == len(READ_AS_JSON)
    made = {s["id"] for s in (await http.get("/v1/sessions")).json()["sessions"]}
    assert made == {session, *(f"made-{i}" for i in range(len(READ_AS_JSON)))}
