"""What needs no key: probes, the OpenAPI document and the web page; and
the edge's metrics, which need an operator key."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from edge.auth import Caller, require_operator
from edge.errors import error_response
from edge.http import api_route, gateway_of, metrics_of, plain_route
from edge.metrics_exposition import exposition
from edge.openapi import OPENAPI
from services.common.errors import KeelError

STATIC = Path(__file__).resolve().parent.parent / "static"
READY_TIMEOUT_S = 2.0
# What a 503 of /readyz tells a client or balancer to wait before asking again.
READY_RETRY_AFTER_S = 1


async def healthz(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def _reachable(call: Awaitable[object]) -> bool:
    try:
        await asyncio.wait_for(call, READY_TIMEOUT_S)
    except (KeelError, TimeoutError):
        return False
    return True


async def readyz(request: Request) -> Response:
    """200 while this edge can take requests: not draining, and both the
    kernel and the ledger answer (each through a call that reaches their
    database). A 503 says which is missing and when to look again."""
    gateway = gateway_of(request)
    retry = {"Retry-After": str(READY_RETRY_AFTER_S)}
    if gateway.draining.is_set():
        return error_response(503, "draining", "this edge is draining", retry)
    kernel, ledger = await asyncio.gather(
        _reachable(gateway.kernel.list_runtimes()),
        _reachable(gateway.ledger.list_sessions(limit=1)),
    )
    missing = [name for name, up in (("kernel", kernel), ("ledger", ledger)) if not up]
    if missing:
        return error_response(503, "unavailable", f"not reachable: {' and '.join(missing)}", retry)
    return JSONResponse({"ready": True})


async def metrics(request: Request, caller: Caller) -> Response:
    """Prometheus metrics, behind the operator key (`Authorization: Bearer`):
    they name routes, statuses and load, which are the operator's business.
    A scraper is given an operator key (Prometheus `authorization` in its
    scrape config)."""
    require_operator(caller)
    text = exposition(metrics_of(request).registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return JSONResponse(OPENAPI)


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


routes: list[BaseRoute] = [
    plain_route("/healthz", healthz, ["GET"]),
    plain_route("/readyz", readyz, ["GET"]),
    api_route("/metrics", metrics, ["GET"]),
    plain_route("/openapi.json", openapi, ["GET"]),
    # The page and its files are the browser's: what a link adds to their
    # URLs (a campaign tag, a cache buster) is no one's business here.
    Route("/", page, methods=["GET"]),
    Mount("/static", StaticFiles(directory=STATIC), name="static"),
]
