"""The runtime: drain it (operator) and report its state (admin or operator)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge.auth import Caller, require_admin, require_operator
from edge.errors import BadRequest
from edge.http import MAX_INT64, api_route, gateway_of, json_body
from edge.runtime_ops import drain_runners, report

DRAIN_MODES = ("handoff", "shutdown")
DEFAULT_DRAIN_DEADLINE_MS = 30_000


async def drain(request: Request, caller: Caller) -> Response:
    gateway = gateway_of(request)
    require_operator(caller)
    body = await json_body(request, {"mode", "deadlineMs", "runtimeId"})
    mode = body.get("mode", "handoff")
    deadline = body.get("deadlineMs", DEFAULT_DRAIN_DEADLINE_MS)
    if mode not in DRAIN_MODES:
        raise BadRequest("mode must be handoff or shutdown")
    if (
        not isinstance(deadline, int)
        or isinstance(deadline, bool)
        or not 0 <= deadline <= MAX_INT64
    ):
        raise BadRequest("deadlineMs must be a non-negative integer")
    runtime_id = body.get("runtimeId")
    if runtime_id is not None and not isinstance(runtime_id, str):
        raise BadRequest("runtimeId must be a string")
    # Drains one runner (runtimeId), or this runtime: its local runners
    # and the edge's SSE clients. Inputs are accepted throughout.
    return JSONResponse(await drain_runners(gateway, mode, deadline, runtime_id), status_code=202)


async def runtime_status(request: Request, caller: Caller) -> Response:
    gateway = gateway_of(request)
    # An operator sees every tenant's sessions; a tenant's admin its own.
    if not caller.operator:
        require_admin(caller)
    return JSONResponse(await report(gateway, caller))


routes: list[Route] = [
    api_route("/v1/runtime/drain", drain, ["POST"]),
    api_route("/v1/runtime/status", runtime_status, ["GET"]),
]
