"""Sessions: create and list them, commit inputs, retry, cancel, read their
facts (SSE or pages) and the context the model saw."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge import forks, inputs, schedules
from edge.auth import Caller
from edge.bodies import (
    CreateSessionBody,
    EditBody,
    ForkBody,
    InputBody,
    RetryBody,
    ScheduleBody,
)
from edge.errors import BadRequest
from edge.gateway import DEFAULT_SESSION_PAGE, MAX_SESSION_PAGE
from edge.http import (
    api_route,
    gateway_of,
    guards_of,
    idempotency_key,
    int_param,
    is_count,
    metrics_of,
    optional_int_param,
    session_id,
    typed_body,
)
from edge.inputs import Committed
from edge.streams import LimitedEventSourceResponse, SessionStream, fact_json

MAX_PAGE = 1000
DEFAULT_PAGE = 500


async def create_session(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, CreateSessionBody)
    created = await gateway_of(request).create_session(caller, body.id)
    return JSONResponse({"id": created}, status_code=201)


async def list_sessions(request: Request, caller: Caller) -> Response:
    after = request.query_params.get("after") or None
    limit = min(int_param(request, "limit", DEFAULT_SESSION_PAGE, minimum=1), MAX_SESSION_PAGE)
    sessions, following = await gateway_of(request).list_sessions(caller, after, limit)
    return JSONResponse({"sessions": sessions, "next": following})


async def get_session(request: Request, caller: Caller) -> Response:
    info = await gateway_of(request).session_info(caller, session_id(request, caller))
    return JSONResponse(info.to_json())


def _committed(committed: Committed) -> Response:
    # 202: a new input, to be answered; 200: this requestId's input, already there.
    return JSONResponse(committed.to_json(), status_code=200 if committed.duplicate else 202)


async def post_input(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, InputBody)
    committed = await inputs.commit_input(
        gateway_of(request), caller, session_id(request, caller), body, idempotency_key(request)
    )
    return _committed(committed)


async def retry_input(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, RetryBody)
    committed = await inputs.retry(
        gateway_of(request), caller, session_id(request, caller), body, idempotency_key(request)
    )
    return _committed(committed)


async def cancel(request: Request, caller: Caller) -> Response:
    cancelled = await inputs.cancel(gateway_of(request), caller, session_id(request, caller))
    if cancelled is None:
        return JSONResponse({"cancelled": False})
    return JSONResponse(cancelled.to_json(), status_code=202)


async def fork(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, ForkBody)
    forked = await forks.fork(gateway_of(request), caller, session_id(request, caller), body)
    return JSONResponse(forked.to_json(), status_code=201)


async def edit(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, EditBody)
    forked = await forks.edit(
        gateway_of(request), caller, session_id(request, caller), body, idempotency_key(request)
    )
    return JSONResponse(forked.to_json(), status_code=201)


async def create_schedule(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, ScheduleBody)
    made = await schedules.create(gateway_of(request), caller, session_id(request, caller), body)
    return JSONResponse(schedules.schedule_json(made), status_code=201)


async def list_schedules(request: Request, caller: Caller) -> Response:
    found = await schedules.listed(gateway_of(request), caller, session_id(request, caller))
    return JSONResponse({"schedules": [schedules.schedule_json(s) for s in found]})


async def delete_schedule(request: Request, caller: Caller) -> Response:
    await schedules.delete(
        gateway_of(request),
        caller,
        session_id(request, caller),
        request.path_params["scheduleId"],
    )
    return Response(status_code=204)


async def skip(request: Request, caller: Caller) -> Response:
    skipped = await inputs.skip(gateway_of(request), caller, session_id(request, caller))
    return JSONResponse(skipped.to_json(), status_code=202)


async def events(request: Request, caller: Caller) -> Response:
    gateway = gateway_of(request)
    ledger_id = session_id(request, caller)
    page_format = request.query_params.get("format") or None
    if page_format not in (None, "json"):
        raise BadRequest("format must be json (a page of facts), or absent for SSE")
    cursor_header = request.headers.get("last-event-id")
    if cursor_header is not None and cursor_header != "":
        if not is_count(cursor_header):
            raise BadRequest("Last-Event-ID must be a seq (a non-negative integer)")
        after = int(cursor_header)
    else:
        after = int_param(request, "after", 0)
    if page_format == "json":
        await gateway.check_cursor(caller, ledger_id, after)
        limit = min(int_param(request, "limit", DEFAULT_PAGE, minimum=1), MAX_PAGE)
        facts, head = await gateway.ledger.read(ledger_id, after, limit)
        return JSONResponse(
            {
                "facts": [fact_json(f) for f in facts],
                "headSeq": head,
                "next": facts[-1].seq if facts else after,
            }
        )
    # Counted before the ledger is asked anything: a key over its limit
    # costs the edge no more than this refusal.
    slot = guards_of(request).streams.acquire(caller)
    try:
        await gateway.check_cursor(caller, ledger_id, after)
    except BaseException:
        slot.release()
        raise
    stream = SessionStream(
        gateway, ledger_id, after, metrics_of(request).sse_clients, caller=caller
    )
    return LimitedEventSourceResponse(stream, slot, gateway.config.keepalive_s)


async def context(request: Request, caller: Caller) -> Response:
    at = optional_int_param(request, "at", minimum=1)
    built = await gateway_of(request).context(caller, session_id(request, caller), at)
    return JSONResponse(built)


routes: list[Route] = [
    api_route("/v1/sessions", create_session, ["POST"]),
    api_route("/v1/sessions", list_sessions, ["GET"], query=("after", "limit")),
    api_route("/v1/sessions/{id}", get_session, ["GET"]),
    api_route("/v1/sessions/{id}/inputs", post_input, ["POST"]),
    api_route("/v1/sessions/{id}/retry", retry_input, ["POST"]),
    api_route("/v1/sessions/{id}/cancel", cancel, ["POST"]),
    api_route("/v1/sessions/{id}/skip", skip, ["POST"]),
    api_route("/v1/sessions/{id}/fork", fork, ["POST"]),
    api_route("/v1/sessions/{id}/edit", edit, ["POST"]),
    api_route("/v1/sessions/{id}/schedules", create_schedule, ["POST"]),
    api_route("/v1/sessions/{id}/schedules", list_schedules, ["GET"]),
    api_route("/v1/sessions/{id}/schedules/{scheduleId}", delete_schedule, ["DELETE"]),
    # EventSource cannot send headers: the one route taking ?access_token=.
    api_route(
        "/v1/sessions/{id}/events",
        events,
        ["GET"],
        query=("after", "limit", "format"),
        query_token=True,
    ),
    api_route("/v1/sessions/{id}/context", context, ["GET"], query=("at",)),
]
