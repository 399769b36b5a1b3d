"""What every route of the edge shares: who is calling, reading the body and
the parameters of a request, and counting requests.

Authentication happens in one place, `api_route`: a route of the API gets
the authenticated `Caller`, or the request is answered 401 (429 for an
address sending too many unknown keys) before it runs. The key comes in the
Authorization header; `?access_token=` only where a route allows it (the SSE
stream, for EventSource, which cannot send headers): anywhere else a key in
a URL, which ends up in logs and histories, is refused.

Every route names the query parameters it takes (`api_route(query=…)`,
`plain_route`): any other is a 400 naming it, as an unknown body field is, so
a misspelt `?pageSize=` is not silently ignored. A JSON body is read by one
rule on every route (`json_body`): without a Content-Type, or with a JSON one,
it is JSON; so it is with the types clients send when told nothing (curl -d:
application/x-www-form-urlencoded; fetch: text/plain); any other is a 415.
Helpers raise `EdgeError`s; the app's exception handlers turn them (and any
service's `KeelError`) into JSON `{error: {code, message}}`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edge import bodies
from edge import metrics as edge_metrics
from edge.auth import Caller
from edge.bodies import B
from edge.errors import BadRequest, EdgeError, Unauthorized, error_response, shown
from edge.gateway import Gateway
from edge.limits import DEFAULT_MAX_BODY_BYTES, Guards, client_address, too_large

log = logging.getLogger(__name__)

# The default limit of a JSON body; `ClientLimits.max_body_bytes` sets it.
MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES
# Seqs, cursors and offsets travel as int64 on the wire.
MAX_INT64 = bodies.MAX_INT64

ApiHandler = Callable[[Request, Caller], Awaitable[Response]]
PlainHandler = Callable[[Request], Awaitable[Response]]
# The key's query parameter, on the one route that takes it (`bearer`).
ACCESS_TOKEN = "access_token"
# Content-Types read as JSON besides application/json and */*+json: what
# curl -d and fetch() send for a body they are told nothing about.
UNTYPED_BODIES = frozenset({"application/x-www-form-urlencoded", "text/plain"})
# The status counted for a request whose client left before its answer (as
# nginx logs it): not the edge's error, so not a 500.
CLIENT_CLOSED = 499


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "keel_edge_requests", "HTTP requests", ["route", "status"], registry=self.registry
        )
        self.sse_clients = Gauge(
            "keel_edge_sse_clients", "Open SSE streams", registry=self.registry
        )


class RequestMetrics:
    """Counts every HTTP request by route name and status, whatever answered
    it: the route, an exception handler, or the router (404, 405).

    A client that left mid-request (starlette's `ClientDisconnect`, e.g. an
    aborted body) is counted as 499 and is no error; any other exception is
    logged once and answered as a JSON 500, so even that answer passes the
    middlewares outside this one (the security headers)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = False

        def count(status: int) -> None:
            nonlocal counted
            counted = True
            # The router records the matched route in the scope; unmatched
            # paths share one label so clients cannot grow the label set.
            route = scope.get("route")
            name = getattr(route, "name", None) or "unmatched"
            self.metrics.requests.labels(name, str(status)).inc()
            edge_metrics.request_answered(name, status)

        async def counting_send(message: Message) -> None:
            # Counted when the response starts: an SSE stream may last hours.
            if message["type"] == "http.response.start" and not counted:
                count(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except ClientDisconnect:
            if not counted:
                count(CLIENT_CLOSED)
        except Exception:
            if counted:
                raise  # the answer has started: only closing the connection is left
            log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            await error_response(500, "internal", "internal error; see the edge's log")(
                scope, receive, counting_send
            )
        finally:
            if not counted:
                count(500)


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def metrics_of(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


def guards_of(request: Request) -> Guards:
    guards: Guards = request.app.state.guards
    return guards


def bearer(request: Request, query_token: bool = False) -> str:
    """The request's key: the Authorization header, or `?access_token=` where
    `query_token` allows it. A key in the URL of any other route is refused
    rather than ignored, so a client leaking its key into URLs finds out."""
    in_query = "access_token" in request.query_params
    if in_query and not query_token:
        raise Unauthorized(
            "access_token in the URL is accepted only on GET /v1/sessions/{id}/events; "
            "send the key as Authorization: Bearer <key>"
        )
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    # EventSource cannot send headers: the one place a key may be in the URL.
    return request.query_params.get("access_token", "") if in_query else ""


def client_host(request: Request) -> str:
    """The peer's address (a proxy's X-Forwarded-For only from a trusted
    proxy: uvicorn applies it, see edge/server.py)."""
    return request.client.host if request.client is not None else ""


async def authenticate(request: Request, query_token: bool = False) -> Caller:
    """The caller of a request, with failed keys limited by client address."""
    address = client_address(client_host(request))
    key = bearer(request, query_token)
    return await gateway_of(request).auth.authenticate(key, address, guards_of(request).failed_keys)


class UnsupportedMediaType(EdgeError):
    """A body sent as something else than JSON where JSON is read."""

    status = 415
    code = "unsupported_media_type"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "UNSUPPORTED_MEDIA_TYPE"


def check_query(request: Request, allowed: Collection[str]) -> None:
    """Refuses a query parameter the route does not take, naming it."""
    for name in request.query_params:
        if name not in allowed:
            takes = ", ".join(sorted(allowed)) if allowed else "no query parameters"
            raise BadRequest(
                f"unknown query parameter {shown(name)}; {request.method} "
                f"{request.url.path} takes {takes}",
                field=name[:64],
            )


class CheckedRoute(Route):
    """A route with the query parameters it takes (the OpenAPI document
    lists the same ones; tests/edge/test_query_params.py holds them equal)."""

    def __init__(
        self,
        path: str,
        endpoint: PlainHandler,
        methods: list[str],
        name: str,
        query: frozenset[str],
    ) -> None:
        super().__init__(path, endpoint, methods=methods, name=name)
        self.query = query


def api_route(
    path: str,
    handler: ApiHandler,
    methods: list[str],
    *,
    query: Collection[str] = (),
    query_token: bool = False,
) -> Route:
    """A route of the API, named after its handler; the one place that
    authenticates: the handler runs only for a known key. `query`: the
    query parameters it takes (any other is a 400). `query_token`: the key
    may come as `?access_token=` (the SSE stream only)."""
    allowed = frozenset(query) | ({ACCESS_TOKEN} if query_token else set())

    async def endpoint(request: Request) -> Response:
        caller = await authenticate(request, query_token)
        check_query(request, allowed)
        return await handler(request, caller)

    return CheckedRoute(path, endpoint, methods, handler.__name__, allowed)


def plain_route(
    path: str,
    handler: PlainHandler,
    methods: list[str],
    *,
    query: Collection[str] = (),
    name: str | None = None,
) -> Route:
    """A route that needs no API key (probes, the document), with the same
    check of its query parameters."""
    allowed = frozenset(query)

    async def endpoint(request: Request) -> Response:
        check_query(request, allowed)
        return await handler(request)

    return CheckedRoute(path, endpoint, methods, name or handler.__name__, allowed)


def body_limit(request: Request) -> int:
    """The most bytes a JSON body of this edge may hold."""
    return guards_of(request).limits.max_body_bytes


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit`:
    from its Content-Length, else while it arrives (never all read first)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def check_json_media(request: Request) -> None:
    """Refuses (415) a body whose Content-Type says it is not JSON."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not media or media == "application/json" or media.endswith("+json"):
        return
    if media in UNTYPED_BODIES:
        return
    raise UnsupportedMediaType(
        f"the body must be JSON (Content-Type: application/json), not {shown(media)}"
    )


async def json_body(request: Request) -> bytes:
    """The raw JSON body of a request, by the one rule of every JSON route:
    its Content-Type checked, its size limited."""
    check_json_media(request)
    return await read_limited(request, body_limit(request))


async def typed_body(request: Request, schema: type[B]) -> B:
    """The request's JSON body decoded into `schema` (an empty body is {}),
    in one pass that refuses bad JSON, wrong types and unknown fields (400)."""
    return bodies.decode(await json_body(request), schema)


def is_count(raw: str) -> bool:
    """ASCII digits only: str.isdigit() also accepts '²', which int() refuses."""
    return 0 < len(raw) <= 19 and raw.isascii() and raw.isdigit() and int(raw) <= MAX_INT64


def int_param(request: Request, name: str, default: int, minimum: int = 0) -> int:
    value = optional_int_param(request, name, minimum)
    return default if value is None else value


def optional_int_param(request: Request, name: str, minimum: int = 0) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer") from None
    if value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}")
    if value > MAX_INT64:
        raise BadRequest(f"{name} must be <= {MAX_INT64}")
    return value


def session_id(request: Request, caller: Caller) -> str:
    """The ledger's id of the session named in the path (ids are per tenant)."""
    return Gateway.ledger_session_id(caller, request.path_params["id"])


def idempotency_key(request: Request) -> str | None:
    """The Idempotency-Key header: another way to send an input's requestId."""
    return request.headers.get("idempotency-key")
