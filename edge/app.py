"""The HTTP API of SPEC §7 on Starlette, plus the web page and probes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from compaction.transcript import request_messages
from edge.errors import (
    BadRequest,
    EdgeError,
    NotFound,
    PayloadTooLarge,
    error_response,
    from_service_error,
)
from edge.gateway import Caller, Gateway
from edge.openapi import OPENAPI
from edge.runtime_ops import drain_runners, report
from edge.streams import SessionStream, fact_json
from services.common.errors import KeelError

STATIC = Path(__file__).resolve().parent / "static"
MAX_BODY_BYTES = 1 << 20
MAX_CHUNK_BYTES = 8 << 20
MAX_PAGE = 1000
# Seqs, cursors and offsets travel as int64 on the wire.
MAX_INT64 = (1 << 63) - 1

Handler = Callable[[Request], Awaitable[Response]]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "keel_edge_requests", "HTTP requests", ["route", "status"], registry=self.registry
        )
        self.sse_clients = Gauge(
            "keel_edge_sse_clients", "Open SSE streams", registry=self.registry
        )


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.query_params.get("access_token", "")


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await _read_limited(request, MAX_BODY_BYTES)
    if not raw:
        return {}
    try:
        body = json.loads(raw)
        # A lone surrogate (`"\ud800"`) parses but cannot be stored as UTF-8.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeError, RecursionError):
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _is_count(raw: str) -> bool:
    """ASCII digits only: str.isdigit() also accepts '²', which int() refuses."""
    return 0 < len(raw) <= 19 and raw.isascii() and raw.isdigit() and int(raw) <= MAX_INT64


def _int_param(request: Request, name: str, default: int, minimum: int = 0) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer") from None
    if value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}")
    if value > MAX_INT64:
        raise BadRequest(f"{name} must be <= {MAX_INT64}")
    return value


def _session_id(request: Request, caller: Caller) -> str:
    """The ledger's id of the session named in the path (ids are per tenant)."""
    return Gateway.ledger_session_id(caller, request.path_params["id"])


def create_app(gateway: Gateway) -> Starlette:
    metrics = Metrics()

    def route(
        path: str, methods: list[str], name: str, auth: bool = True
    ) -> Callable[[Callable[..., Awaitable[Response]]], Route]:
        def wrap(handler: Callable[..., Awaitable[Response]]) -> Route:
            async def endpoint(request: Request) -> Response:
                status = 500
                try:
                    if auth:
                        caller = await gateway.authenticate(_bearer(request))
                        response = await handler(request, caller)
                    else:
                        response = await handler(request)
                    status = response.status_code
                    return response
                except EdgeError as error:
                    status = error.status
                    return error.response()
                except KeelError as error:
                    mapped = from_service_error(error)
                    status = mapped.status
                    return mapped.response()
                finally:
                    metrics.requests.labels(name, str(status)).inc()

            return Route(path, endpoint, methods=methods, name=name)

        return wrap

    @route("/v1/sessions", ["POST"], "create_session")
    async def create_session(request: Request, caller: Caller) -> Response:
        body = await _json_body(request)
        wanted = body.get("id")
        if wanted is not None and not isinstance(wanted, str):
            raise BadRequest("id must be a string")
        session_id = await gateway.create_session(caller, wanted)
        return JSONResponse({"id": session_id}, status_code=201)

    @route("/v1/sessions", ["GET"], "list_sessions")
    async def list_sessions(request: Request, caller: Caller) -> Response:
        return JSONResponse({"sessions": await gateway.list_sessions(caller)})

    @route("/v1/sessions/{id}", ["GET"], "get_session")
    async def get_session(request: Request, caller: Caller) -> Response:
        view = await gateway.session(caller, _session_id(request, caller))
        return JSONResponse(
            {
                "id": gateway.public_session_id(view.session_id),
                "headSeq": view.head_seq,
                "status": await gateway.status_of(view),
                "owedInputs": list(view.owed_input_seqs),
                "latestCompactionSeq": view.latest_compaction_seq,
            }
        )

    @route("/v1/sessions/{id}/inputs", ["POST"], "post_input")
    async def post_input(request: Request, caller: Caller) -> Response:
        body = await _json_body(request)
        seq, duplicate = await gateway.commit_input(caller, _session_id(request, caller), body)
        return JSONResponse({"seq": seq}, status_code=200 if duplicate else 202)

    @route("/v1/sessions/{id}/retry", ["POST"], "retry_input")
    async def retry_input(request: Request, caller: Caller) -> Response:
        body = await _json_body(request)
        session_id = _session_id(request, caller)
        await gateway.session(caller, session_id)
        seq, _ = await gateway.retry(caller, session_id, body.get("seq"))
        return JSONResponse({"seq": seq}, status_code=202)

    @route("/v1/sessions/{id}/cancel", ["POST"], "cancel")
    async def cancel(request: Request, caller: Caller) -> Response:
        seq = await gateway.cancel(caller, _session_id(request, caller))
        return JSONResponse({"seq": seq}, status_code=202)

    @route("/v1/sessions/{id}/events", ["GET"], "events")
    async def events(request: Request, caller: Caller) -> Response:
        session_id = _session_id(request, caller)
        view = await gateway.session(caller, session_id)
        cursor_header = request.headers.get("last-event-id")
        if cursor_header is not None and cursor_header != "":
            if not _is_count(cursor_header):
                raise BadRequest("Last-Event-ID must be a seq (a non-negative integer)")
            after = int(cursor_header)
        else:
            after = _int_param(request, "after", 0)
        if after > view.head_seq:
            # A cursor from the future would silently skip facts until the
            # session caught up with it: refuse it instead.
            raise BadRequest(f"cursor {after} is beyond the session's head {view.head_seq}")
        if request.query_params.get("format") == "json":
            limit = min(_int_param(request, "limit", 500, minimum=1), MAX_PAGE)
            facts, head = await gateway.ledger.read(session_id, after, limit)
            return JSONResponse(
                {
                    "facts": [fact_json(f) for f in facts],
                    "headSeq": head,
                    "next": facts[-1].seq if facts else after,
                }
            )
        stream = SessionStream(gateway, session_id, after, metrics.sse_clients)
        return EventSourceResponse(
            stream.events(),
            ping=gateway.config.keepalive_s,
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    @route("/v1/sessions/{id}/context", ["GET"], "context")
    async def context(request: Request, caller: Caller) -> Response:
        session_id = _session_id(request, caller)
        view = await gateway.session(caller, session_id)
        at = _int_param(request, "at", view.head_seq, minimum=1)
        facts = [f for f in await gateway.ledger.read_all(session_id) if f.seq <= at]
        loadout = await gateway.kernel.get_loadout(caller.tenant_id)
        compactions = [f.seq for f in facts if f.kind == "compaction"]
        return JSONResponse(
            {
                "at": at,
                "systemPrompt": loadout.document.get("systemPrompt", ""),
                "messages": list(request_messages(facts)),
                "compactionSeq": compactions[-1] if compactions else 0,
            }
        )

    @route("/v1/blobs", ["POST"], "create_blob")
    async def create_blob(request: Request, caller: Caller) -> Response:
        body = await _json_body(request)
        length = body.get("length")
        if not isinstance(length, int) or isinstance(length, bool):
            raise BadRequest("length (integer) is required")
        content_type = body.get("contentType", "application/octet-stream")
        if not isinstance(content_type, str):
            raise BadRequest("contentType must be a string")
        info = await asyncio.to_thread(gateway.blobs.create, caller.tenant_id, length, content_type)
        return JSONResponse(info.to_json(), status_code=201, headers={"Upload-Offset": "0"})

    @route("/v1/blobs/{id}", ["HEAD", "GET"], "blob_offset")
    async def blob_offset(request: Request, caller: Caller) -> Response:
        info = await asyncio.to_thread(
            gateway.blobs.get, caller.tenant_id, request.path_params["id"]
        )
        headers = {"Upload-Offset": str(info.offset), "Upload-Length": str(info.length)}
        if request.method == "HEAD":
            return Response(status_code=200, headers=headers)
        return JSONResponse(info.to_json(), headers=headers)

    @route("/v1/blobs/{id}", ["PATCH"], "append_blob")
    async def append_blob(request: Request, caller: Caller) -> Response:
        raw_offset = request.headers.get("upload-offset", "")
        if not _is_count(raw_offset):
            raise BadRequest("Upload-Offset header (non-negative integer) is required")
        chunk = await _read_limited(request, MAX_CHUNK_BYTES)
        info = await asyncio.to_thread(
            gateway.blobs.append,
            caller.tenant_id,
            request.path_params["id"],
            int(raw_offset),
            chunk,
        )
        return JSONResponse(info.to_json(), headers={"Upload-Offset": str(info.offset)})

    @route("/v1/runtime/drain", ["POST"], "drain")
    async def drain(request: Request, caller: Caller) -> Response:
        gateway.require_admin(caller)
        body = await _json_body(request)
        mode = body.get("mode", "handoff")
        deadline = body.get("deadlineMs", 30_000)
        if mode not in ("handoff", "shutdown"):
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
        result = await drain_runners(gateway, mode, deadline, runtime_id)
        return JSONResponse(result, status_code=202)

    @route("/v1/runtime/status", ["GET"], "runtime_status")
    async def runtime_status(request: Request, caller: Caller) -> Response:
        gateway.require_admin(caller)
        return JSONResponse(await report(gateway))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def readyz(request: Request) -> Response:
        if gateway.draining.is_set():
            return error_response(503, "draining", "this edge is draining")
        try:
            await asyncio.wait_for(gateway.kernel.list_runtimes(), 2)
        except (KeelError, TimeoutError):
            return error_response(503, "unavailable", "the kernel is not reachable")
        return JSONResponse({"ready": True})

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(request: Request) -> Response:
        return JSONResponse(OPENAPI)

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def not_found(request: Request, exc: Exception) -> Response:
        return NotFound("no such route").response()

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(405, "method_not_allowed", "method not allowed on this route")

    routes = [
        create_session,
        list_sessions,
        get_session,
        post_input,
        retry_input,
        cancel,
        events,
        context,
        create_blob,
        blob_offset,
        append_blob,
        drain,
        runtime_status,
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", prometheus),
        Route("/openapi.json", openapi),
        Route("/", index),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed})
    app.state.gateway = gateway
    return app
