"""A query parameter a route does not take is refused, naming it.

Reproduced: `GET /v1/sessions?pageSize=5` answered a page of the default size,
as if the client had been understood. Unknown body fields were refused; now
unknown query parameters are too, on every route of the API and the probes,
while every parameter a route documents (and the web page and the CLI send)
still works. The OpenAPI document lists exactly what each route takes.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from edge.app import create_app
from edge.http import CheckedRoute
from edge.openapi import OPENAPI
from tests.support.edge_stack import ADMIN_KEY, Stack

_PATH_PARAMETER = re.compile(r"\{(\w+)\}")


def _checked_routes(stack: Stack) -> list[CheckedRoute]:
    routes = [r for r in create_app(stack.gateway).routes if isinstance(r, CheckedRoute)]
    assert len(routes) > 20
    return routes


def _documented_query(path: str, method: str) -> set[str]:
    item = OPENAPI["paths"][path]
    parameters: list[dict[str, Any]] = [
        *item.get("parameters", []),
        *item[method].get("parameters", []),
    ]
    return {p["name"] for p in parameters if p["in"] == "query"}


async def test_every_route_refuses_a_query_parameter_it_does_not_take(stack: Stack) -> None:
    session = await stack.new_session("query-params")
    for route in _checked_routes(stack):
        path = _PATH_PARAMETER.sub(lambda m: session if m[1] == "id" else "x", route.path)
        for method in sorted(route.methods or ()):
            if method == "HEAD":
                continue
            response = await stack.http.request(method, path, params={"pageSize": "5"})
            where = f"{method} {route.path}"
            assert response.status_code == 400, (where, response.text)
            message = response.json()["error"]["message"]
            assert "unknown query parameter 'pageSize'" in message, (where, message)
    # A parameter of another route is unknown here, and said to be.
    response = await stack.http.get("/v1/sessions", params={"at": "1"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].endswith("takes after, limit")
    # Nothing was done by a refused request.
    sessions = (await stack.http.get("/v1/sessions")).json()["sessions"]
    assert [s["id"] for s in sessions] == [session]


async def test_the_parameters_routes_take_still_work(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session("known-params")
    await stack.post_input(session, "hello", "known-1")
    assert (await http.get("/v1/sessions", params={"after": "a", "limit": "5"})).status_code == 200
    # The web page's page of facts (api.js), its resumed stream (stream.js),
    # the inspector's context (inspector.js), the CLI's key filter.
    page = await http.get(
        f"/v1/sessions/{session}/events", params={"format": "json", "after": "0", "limit": "10"}
    )
    assert page.status_code == 200 and page.json()["facts"], page.text
    context = await http.get(f"/v1/sessions/{session}/context", params={"at": "1"})
    assert context.status_code == 200, context.text
    assert (await http.get("/v1/keys", params={"tenant": "default"})).status_code == 200
    # EventSource's key, and the resume cursor, on the stream.
    async with (
        httpx.AsyncClient(base_url=stack.url) as anonymous,
        anonymous.stream(
            "GET",
            f"/v1/sessions/{session}/events",
            params={"after": "1", "access_token": ADMIN_KEY},
        ) as stream,
    ):
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
    # A key in the URL anywhere else is still a 401 (never silently taken).
    keyed = await http.get("/v1/sessions", params={"access_token": ADMIN_KEY})
    assert keyed.status_code == 401
    # The page is the browser's: what a link adds to its URL is no refusal.
    async with httpx.AsyncClient(base_url=stack.url) as browser:
        assert (await browser.get("/", params={"utm_source": "mail"})).status_code == 200


async def test_the_document_lists_what_each_route_takes(stack: Stack) -> None:
    listed = 0
    for route in _checked_routes(stack):
        for method in route.methods or ():
            if method == "HEAD" and "head" not in OPENAPI["paths"][route.path]:
                continue
            documented = _documented_query(route.path, method.lower())
            assert documented == set(route.query), (method, route.path)
            listed += bool(documented)
            responses = OPENAPI["paths"][route.path][method.lower()]["responses"]
            assert "400" in responses and "431" in responses, (method, route.path)
    assert listed == 4
