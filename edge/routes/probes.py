"""What needs no key: probes, the OpenAPI document and the web page; and
the edge's metrics, which need an operator key."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from edge.auth import Caller, require_operator
from edge.errors import error_response
from edge.http import api_route, gateway_of, metrics_of
from edge.openapi import OPENAPI
from services.common.errors import KeelError

STATIC = Path(__file__).resolve().parent.parent / "static"
READY_TIMEOUT_S = 2.0


async def healthz(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def readyz(request: Request) -> Response:
    gateway = gateway_of(request)
    if gateway.draining.is_set():
        return error_response(503, "draining", "this edge is draining")
    try:
        await asyncio.wait_for(gateway.kernel.list_runtimes(), READY_TIMEOUT_S)
    except (KeelError, TimeoutError):
        return error_response(503, "unavailable", "the kernel is not reachable")
    return JSONResponse({"ready": True})


async def metrics(request: Request, caller: Caller) -> Response:
    """Prometheus metrics, behind the operator key (`Authorization: Bearer`):
    they name routes, statuses and load, which are the operator's business.
    A scraper is given an operator key (Prometheus `authorization` in its
    scrape config)."""
    require_operator(caller)
    return Response(generate_latest(metrics_of(request).registry), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return JSONResponse(OPENAPI)


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


routes: list[BaseRoute] = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    api_route("/metrics", metrics, ["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
    Route("/", page, methods=["GET"]),
    Mount("/static", StaticFiles(directory=STATIC), name="static"),
]
