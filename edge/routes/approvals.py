"""Approvals: a person's decision on a tool call that waits for one."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge import approvals
from edge.auth import Caller
from edge.http import api_route, gateway_of, json_body, session_id


async def decide(request: Request, caller: Caller) -> Response:
    body = await json_body(request, {"toolCallId", "approve", "note"})
    decided = await approvals.decide(gateway_of(request), caller, session_id(request, caller), body)
    # 201: the decision is a new fact; a repeat is a 409, never a second one.
    return JSONResponse(decided.to_json(), status_code=201)


routes: list[Route] = [
    api_route("/v1/sessions/{id}/approvals", decide, ["POST"]),
]
