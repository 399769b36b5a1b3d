"""Tenant configuration over HTTP: the loadout, tenants and API keys.

Thin: each handler reads the request, calls edge/admin_ops.py (which the
gRPC front door calls too) and shapes the JSON answer.

`PUT /v1/loadout` takes the document itself, or what `GET /v1/loadout`
answered (`{revision, document}`, edited): then the revision is the put's
If-Match, so a read-modify-write of what was read is refused (412) if
someone stored another revision meanwhile.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge import admin_ops
from edge.auth import Caller
from edge.bodies import CreateKeyBody, CreateTenantBody
from edge.errors import BadRequest
from edge.http import api_route, gateway_of, is_count, json_body, typed_body

# The members of GET /v1/loadout's answer; no loadout field is named so.
READ_BACK = frozenset({"revision", "document"})


def _etag(revision: int) -> str:
    return f'"{revision}"'


def _if_match(request: Request) -> int:
    """The revision If-Match names (0: none, the put is unconditional).
    Accepts the ETag GET /v1/loadout sent (`"3"`) or the bare number."""
    raw = request.headers.get("if-match")
    if raw is None or raw.strip() == "":
        return 0
    value = raw.strip()
    if value.startswith("W/"):
        value = value[2:]
    value = value.strip('"')
    if not is_count(value):
        raise BadRequest('If-Match must be a loadout revision, as GET /v1/loadout\'s ETag ("3")')
    return int(value)


async def _document(request: Request) -> Any:
    """The body as JSON (None: no body at all)."""
    raw = await json_body(request)
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeError, RecursionError):
        raise BadRequest("the body is not valid JSON") from None


def _read_back(body: Any, if_match: int) -> tuple[Any, int]:
    """(document, expected revision) of a PUT body: the document itself, or
    GET /v1/loadout's answer, whose revision is an If-Match."""
    if not isinstance(body, dict) or "document" not in body or not body.keys() <= READ_BACK:
        return body, if_match
    revision = body.get("revision")
    if revision is None:
        return body["document"], if_match
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        raise BadRequest(
            "revision: the loadout revision GET /v1/loadout answered (an integer >= 0)",
            field="revision",
        )
    if if_match and revision and if_match != revision:
        raise BadRequest(
            f"If-Match names revision {if_match} and the body revision {revision}; send one",
            field="revision",
        )
    return body["document"], if_match or revision


async def get_loadout(request: Request, caller: Caller) -> Response:
    revision, document = await admin_ops.get_loadout(gateway_of(request), caller)
    return JSONResponse(
        {"revision": revision, "document": document}, headers={"ETag": _etag(revision)}
    )


async def put_loadout(request: Request, caller: Caller) -> Response:
    document, expected = _read_back(await _document(request), _if_match(request))
    revision = await admin_ops.put_loadout(gateway_of(request), caller, document, expected)
    return JSONResponse({"revision": revision}, headers={"ETag": _etag(revision)})


async def list_tenants(request: Request, caller: Caller) -> Response:
    tenants = await admin_ops.list_tenants(gateway_of(request), caller)
    return JSONResponse({"tenants": [t.to_json() for t in tenants]})


async def create_tenant(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, CreateTenantBody)
    created = await admin_ops.create_tenant(gateway_of(request), caller, body.id, body.name)
    return JSONResponse(
        {"id": body.id, "name": body.name, "created": created},
        status_code=201 if created else 200,
    )


async def list_keys(request: Request, caller: Caller) -> Response:
    tenant = request.query_params.get("tenant") or None
    keys = await admin_ops.list_keys(gateway_of(request), caller, tenant)
    return JSONResponse({"keys": [k.to_json() for k in keys]})


async def create_key(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, CreateKeyBody)
    tenant, admin, operator = body.tenant, body.admin, body.operator
    key_id, key = await admin_ops.create_key(
        gateway_of(request), caller, tenant, admin=admin, operator=operator
    )
    return JSONResponse(
        {
            "id": key_id,
            "key": key,
            "tenant": tenant or caller.tenant_id,
            "admin": admin,
            "operator": operator,
        },
        status_code=201,
    )


async def revoke_key(request: Request, caller: Caller) -> Response:
    key_id = request.path_params["keyId"]
    revoked = await admin_ops.revoke_key(gateway_of(request), caller, key_id)
    return JSONResponse({"id": key_id, "revoked": revoked})


routes: list[Route] = [
    api_route("/v1/loadout", get_loadout, ["GET"]),
    api_route("/v1/loadout", put_loadout, ["PUT"]),
    api_route("/v1/tenants", list_tenants, ["GET"]),
    api_route("/v1/tenants", create_tenant, ["POST"]),
    api_route("/v1/keys", list_keys, ["GET"], query=("tenant",)),
    api_route("/v1/keys", create_key, ["POST"]),
    api_route("/v1/keys/{keyId}", revoke_key, ["DELETE"]),
]
