"""The HTTP API of SPEC §7 on Starlette, plus the web page and probes.

The routes live in edge/routes/, one module per part of the API; this module
assembles them with what they share: the gateway, the metrics and the
client limits' state (on `app.state`), and the middlewares every request
passes, outermost first:

- OpenTelemetry's ASGI middleware (only when spans are exported): the
  request's server span, continuing a caller's W3C traceparent;
- `SecurityHeaders`: nosniff, CSP with frame-ancestors, no referrer;
- `RequestMetrics`: counts each request by route and status (a client that
  left is a 499, not a 500);
- `BodyDeadline`: a body that stops arriving is a 408.

The exception handlers make every refusal a JSON `{error: {code, message}}`,
so routes raise instead of catching.
"""

from __future__ import annotations

from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from edge.errors import (
    EdgeError,
    MethodNotAllowed,
    NotFound,
    handle_edge_error,
    handle_service_error,
)
from edge.gateway import Gateway
from edge.http import Metrics, RequestMetrics
from edge.limits import Guards
from edge.routes import admin, approvals, blobs, probes, runtime, sessions
from edge.security_headers import SecurityHeaders
from edge.slow_clients import BodyDeadline
from services.common.errors import KeelError


async def _no_route(request: Request, error: Exception) -> Response:
    return NotFound("no such route").response()


async def _wrong_method(request: Request, error: Exception) -> Response:
    response = MethodNotAllowed("method not allowed on this route").response()
    if isinstance(error, HTTPException) and error.headers:
        response.headers.update(error.headers)  # Allow: the methods that are
    return response


def _tracing(gateway: Gateway) -> list[Middleware]:
    """The server span of each request, outermost, continuing a caller's W3C
    traceparent; none when spans go nowhere. Only the request is a span (not
    each body chunk or SSE frame), and probes are not traced."""
    if not gateway.settings.tracing:
        return []
    return [
        Middleware(
            OpenTelemetryMiddleware,
            excluded_urls="/healthz,/readyz,/metrics",
            exclude_spans=["receive", "send"],
        )
    ]


def create_app(gateway: Gateway, guards: Guards | None = None) -> Starlette:
    """The edge's app; `guards` are shared with the gRPC API of the same
    edge (stream limits count both doors), else this app's own."""
    guards = guards or Guards.of()
    metrics = Metrics()
    routes: list[BaseRoute] = [
        *sessions.routes,
        *approvals.routes,
        *blobs.routes,
        *runtime.routes,
        *admin.routes,
        *probes.routes,
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            *_tracing(gateway),
            Middleware(SecurityHeaders),
            Middleware(RequestMetrics, metrics=metrics),
            Middleware(BodyDeadline, limits=guards.limits),
        ],
        exception_handlers={
            EdgeError: handle_edge_error,
            KeelError: handle_service_error,
            404: _no_route,
            405: _wrong_method,
        },
    )
    app.state.gateway = gateway
    app.state.metrics = metrics
    app.state.guards = guards
    return app
