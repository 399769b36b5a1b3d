"""The HTTP API of SPEC §7 on Starlette, plus the web page and probes.

The routes live in edge/routes/, one module per part of the API; this module
assembles them with what they share: the gateway, the metrics and the
client limits' state (on `app.state`), and the middlewares every request
passes, outermost first:

- OpenTelemetry's ASGI middleware (only when spans are exported): the
  request's server span, continuing a caller's W3C traceparent, named after
  the route's template (`POST /v1/sessions/{id}/inputs`), never the path
  itself: span names must stay few, whatever ids clients send;
- `SecurityHeaders`: nosniff, CSP with frame-ancestors, no referrer;
- `RequestMetrics`: counts each request by route and status (a client that
  left is a 499, not a 500);
- `BodyDeadline`: a body that stops arriving is a 408.

The exception handlers make every refusal a JSON `{error: {code, message}}`,
so routes raise instead of catching.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.util.http import sanitize_method
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Mount

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


def _route_template(routes: Sequence[BaseRoute], scope: dict[str, Any]) -> str | None:
    """The template of the route `scope` is for (a route that only lacks
    the method still names it), None for no route. The middleware runs
    before the router, so it asks the routes as the router will."""
    partial: str | None = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.NONE:
            continue
        path = str(getattr(route, "path", ""))
        template = f"{path}/{{path}}" if isinstance(route, Mount) else path
        if match is Match.FULL:
            return template
        partial = partial or template
    return partial


def span_details(
    routes: Sequence[BaseRoute],
) -> Callable[[dict[str, Any]], tuple[str, dict[str, str]]]:
    """The name and attributes of a request's server span: the method and
    the route's template, or the method alone for no route."""

    def details(scope: dict[str, Any]) -> tuple[str, dict[str, str]]:
        method = sanitize_method(str(scope.get("method", "")).strip())
        method = "HTTP" if method == "_OTHER" else method
        template = _route_template(routes, scope)
        if template is None:
            return method, {}
        return f"{method} {template}", {"http.route": template}

    return details


def _tracing(gateway: Gateway, routes: Sequence[BaseRoute]) -> list[Middleware]:
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
            default_span_details=span_details(routes),
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
            *_tracing(gateway, routes),
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
