"""Approvals: a person's decision on a tool call that waits for one."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge import approvals
from edge.auth import Caller
from edge.bodies import DecisionBody
from edge.http import api_route, gateway_of, session_id, typed_body


async def decide(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, DecisionBody)
    decided = await approvals.decide(gateway_of(request), caller, session_id(request, caller), body)
    # 201: the decision is a new fact; a repeat is a 409, never a second one.
    return JSONResponse(decided.to_json(), status_code=201)


routes: list[Route] = [
    api_route("/v1/sessions/{id}/approvals", decide, ["POST"]),
]
