"""The runtime: drain it and undo that (operator), report its state (admin
or operator), and the local drain `keel drain --local` sends this edge.

The local drain is not part of the public API: it is answered only to a
caller on this host (loopback) holding the internal token, which the
processes of one pod or one `keel up` share.
"""

from __future__ import annotations

import hmac
import ipaddress

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge.auth import Caller, require_admin, require_operator
from edge.bodies import DrainBody, LocalDrainBody, UndoDrainBody
from edge.errors import BadRequest, Conflict, Forbidden, Unauthorized
from edge.gateway import Gateway
from edge.http import api_route, client_host, gateway_of, plain_route, typed_body
from edge.runtime_ops import drain_runtimes, drain_this_edge, undo_drains
from edge.runtime_status import report
from kernel.domain import DrainMode
from services.common.internal_auth import TOKEN_HEADER
from services.common.runtime_records import LOCAL_DRAIN_PATH

DRAIN_MODES = (DrainMode.HANDOFF, DrainMode.SHUTDOWN)


def _mode_and_deadline(body: DrainBody, gateway: Gateway) -> tuple[DrainMode, int]:
    if body.mode not in DRAIN_MODES:
        raise BadRequest("mode must be handoff or shutdown", field="mode")
    mode = DrainMode(body.mode)
    deadline = body.deadline_ms
    if isinstance(deadline, msgspec.UnsetType):
        return mode, gateway.config.drain_deadline_ms
    return mode, deadline


async def drain(request: Request, caller: Caller) -> Response:
    gateway = gateway_of(request)
    require_operator(caller)
    body = await typed_body(request, DrainBody)
    mode, deadline = _mode_and_deadline(body, gateway)
    # One runtime (runtimeId: a runner, or this edge), else every attached
    # runner of the deployment. Inputs are accepted throughout.
    result = await drain_runtimes(gateway, mode, deadline, body.runtime_id)
    return JSONResponse(result, status_code=202)


async def undo_drain(request: Request, caller: Caller) -> Response:
    gateway = gateway_of(request)
    require_operator(caller)
    body = await typed_body(request, UndoDrainBody)
    return JSONResponse(await undo_drains(gateway, body.runtime_id))


async def runtime_status(request: Request, caller: Caller) -> Response:
    gateway = gateway_of(request)
    # An operator sees every tenant's sessions; a tenant's admin its own.
    if not caller.operator:
        require_admin(caller)
    return JSONResponse(await report(gateway, caller))


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _require_local_caller(request: Request, gateway: Gateway) -> None:
    token = gateway.settings.internal_token
    if not token:
        raise Forbidden("this edge has no internal token (KEEL_INTERNAL_TOKEN): no local drain")
    if not _is_loopback(client_host(request)):
        raise Forbidden("a local drain is accepted from this host only")
    given = request.headers.get(TOKEN_HEADER, "")
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise Unauthorized(f"a local drain needs the internal token in {TOKEN_HEADER}")


async def local_drain(request: Request) -> Response:
    """Drains this edge (or, with `undo`, undoes that); answers once the
    drain has finished: its streams are gone or the deadline has passed."""
    gateway = gateway_of(request)
    _require_local_caller(request, gateway)
    body = await typed_body(request, LocalDrainBody)
    runtime_id = body.runtime_id
    if runtime_id is not None and runtime_id != gateway.edge_id:
        # A stale record: another edge process listens where it pointed.
        raise Conflict(f"this is edge {gateway.edge_id}, not {runtime_id}")
    if body.undo:
        if gateway.drained.is_set():
            raise Conflict("this edge has finished draining: it is being replaced")
        return JSONResponse({"edge": gateway.edge_id, "undone": gateway.stop_draining()})
    mode, deadline = _mode_and_deadline(body, gateway)
    open_streams = await drain_this_edge(gateway, mode, deadline)
    return JSONResponse(
        {
            "edge": gateway.edge_id,
            "mode": mode,
            "openStreams": open_streams,
            "finished": gateway.drained.is_set(),
        }
    )


routes: list[Route] = [
    api_route("/v1/runtime/drain", drain, ["POST"]),
    api_route("/v1/runtime/drain/undo", undo_drain, ["POST"]),
    api_route("/v1/runtime/status", runtime_status, ["GET"]),
    plain_route(LOCAL_DRAIN_PATH, local_drain, ["POST"]),
]
