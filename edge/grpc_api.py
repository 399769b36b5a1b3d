"""The public gRPC API of SPEC §11, keel.sessions.v1.SessionService.

A second front door onto the same gateway operations the HTTP routes call
(edge/gateway.py, edge/admin_ops.py): each RPC authenticates the
`authorization: Bearer <key>` metadata, turns the request into the
operation's arguments, calls it, and turns the result into the response.
Decisions (who may do what, what is valid, what a cursor may be) live in the
gateway, so both doors answer alike.

Errors are the edge's own (`EdgeError`, and a service's `KeelError` through
`from_service_error`, the same mapping the HTTP API uses): each names its gRPC
code, its `ErrorInfo.reason` and metadata (the refused `field`, ...);
UNAVAILABLE also carries a RetryInfo.

StreamEvents follows the session through the fan-out the SSE stream uses
(edge/fanout.py): facts after `after_seq`, backlog then live, with the
owner's partials and status changes, and a `Drain` before the stream ends
when the edge drains; it ends UNAUTHENTICATED (reason API_KEY_REVOKED) when
the key it was opened with is revoked (edge/key_streams.py). Its messages
are the fan-out's shared frames, serialized once for every stream of the
session (edge/frames.py): the handler yields their bytes, which its
serializer passes on as they are.

The HTTP API's limits hold here too, in the same counts (edge/limits.py):
unknown keys per client address (the peer's, from `context.peer()`), and
event streams per key and tenant, SSE and StreamEvents together; beyond
either, RESOURCE_EXHAUSTED (with a RetryInfo for failed keys). A request
message over the HTTP body limit is INVALID_ARGUMENT `PAYLOAD_TOO_LARGE`
(its metadata names the `limit`).

Each RPC decodes its own request (`_method_handler`): bytes that are not the
request message are INVALID_ARGUMENT `MALFORMED_REQUEST`, where gRPC's own
decoding would answer UNKNOWN.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from edge import admin_ops, approvals, forks, inputs, schedules
from edge.auth import Caller
from edge.errors import BadRequest, EdgeError, from_service_error
from edge.fanout import Drain
from edge.gateway import DEFAULT_SESSION_PAGE, Gateway, SessionInfo
from edge.inputs import Committed
from edge.limits import Guards, client_address, too_large
from edge.refusals import REFUSALS
from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from kernel.schedules import Schedule
from services.common.errors import KeelError, guarded, rich_status
from services.common.serving import GrpcService

log = logging.getLogger(__name__)

SERVICE_NAME = "keel.sessions.v1.SessionService"
# How long a caller told UNAVAILABLE should wait before trying again.
UNAVAILABLE_RETRY_MS = 1000


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def status_of(error: EdgeError) -> grpc.Status:
    """The gRPC status of an edge refusal: code, message, ErrorInfo (and
    RetryInfo when the caller may come back)."""
    retry = error.retry_after_s * 1000
    if not retry and error.grpc_code == grpc.StatusCode.UNAVAILABLE:
        retry = UNAVAILABLE_RETRY_MS
    return rich_status(error.grpc_code, error.reason, error.message, error.metadata, retry)


def _edge_error(error: Exception) -> EdgeError | None:
    if isinstance(error, EdgeError):
        return error
    if isinstance(error, KeelError):
        return from_service_error(error)
    return None


async def _abort(context: Any, error: Exception, rpc: str) -> None:
    refusal = _edge_error(error)
    if refusal is None:
        # A bug: the caller learns no more than HTTP's 500 would say.
        log.error("unexpected error in %s", rpc, exc_info=error)
        refusal = EdgeError("internal error; see the edge's log")
    elif refusal.grpc_code == grpc.StatusCode.UNAVAILABLE:
        REFUSALS.refused(f"{rpc}: {refusal.message} ({refusal.reason})")
    await context.abort_with_status(status_of(refusal))


# Every RPC's refusals leave through `_abort`, in the one shape the internal
# services use too.
_unary, _streaming = guarded(_abort)


# ------------------------------------------------------------------ messages


def _session_pb(info: SessionInfo) -> pb.GetSessionResponse:
    return pb.GetSessionResponse(
        session_id=info.session_id,
        head_seq=info.head_seq,
        status=info.status,
        owed_input_seqs=info.owed_input_seqs,
        latest_compaction_seq=info.latest_compaction_seq,
        parked_on=info.parked_on,
        parked_reason=info.parked_reason,
        pending_approvals=[
            pb.PendingApproval(
                tool_call_id=p.tool_call_id,
                name=p.name,
                arguments_json=_json(p.arguments),
                seq=p.seq,
            )
            for p in info.pending_approvals
        ],
    )


def _optional(value: str) -> str | None:
    """proto3 has no absent string: empty means not given."""
    return value or None


def bearer(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    for key, value in context.invocation_metadata() or ():
        if (
            key == "authorization"
            and isinstance(value, str)
            and value.lower().startswith("bearer ")
        ):
            return value[7:].strip()
    return ""


def peer_host(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The caller's address from `ipv4:1.2.3.4:5678` or `ipv6:[::1]:5678`
    (percent-encoded by some gRPC versions); a unix socket's path as is."""
    peer = urllib.parse.unquote(context.peer() or "")
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6"):
        return peer
    return rest.rpartition(":")[0].strip("[]")


# ------------------------------------------------------------------ service


class SessionServicer(pb_grpc.SessionServiceServicer):
    def __init__(self, gateway: Gateway, guards: Guards) -> None:
        self._gateway = gateway
        self._guards = guards

    @property
    def max_request_bytes(self) -> int:
        return self._guards.limits.max_body_bytes

    async def _caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> Caller:
        return await self._gateway.auth.authenticate(
            bearer(context), client_address(peer_host(context)), self._guards.failed_keys
        )

    async def _session(
        self, context: grpc.aio.ServicerContext[Any, Any], session_id: str
    ) -> tuple[Caller, str]:
        """The caller and the ledger's id of the caller's `session_id`."""
        caller = await self._caller(context)
        return caller, self._gateway.ledger_session_id(caller, session_id)

    @_unary
    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Any
    ) -> pb.CreateSessionResponse:
        caller = await self._caller(context)
        created = await self._gateway.create_session(caller, _optional(request.session_id))
        return pb.CreateSessionResponse(session_id=created)

    @_unary
    async def GetSession(
        self, request: pb.GetSessionRequest, context: Any
    ) -> pb.GetSessionResponse:
        caller, session_id = await self._session(context, request.session_id)
        return _session_pb(await self._gateway.session_info(caller, session_id))

    @_unary
    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Any
    ) -> pb.ListSessionsResponse:
        caller = await self._caller(context)
        if request.page_size < 0:
            raise BadRequest("page_size must be >= 0", field="page_size")
        sessions, following = await self._gateway.list_sessions(
            caller, _optional(request.page_token), request.page_size or DEFAULT_SESSION_PAGE
        )
        return pb.ListSessionsResponse(
            sessions=[
                pb.SessionSummary(session_id=s["id"], head_seq=s["headSeq"]) for s in sessions
            ],
            next_page_token=following or "",
        )

    @_unary
    async def SendInput(self, request: pb.SendInputRequest, context: Any) -> pb.SendInputResponse:
        caller, session_id = await self._session(context, request.session_id)
        body: dict[str, Any] = {"text": request.text}
        if request.request_id:
            body["requestId"] = request.request_id
        if request.blob_ids:
            body["blobs"] = list(request.blob_ids)
        if request.multitask:
            body["multitask"] = request.multitask
        committed = await inputs.commit_input(self._gateway, caller, session_id, body)
        return pb.SendInputResponse(**_committed(committed))

    @_unary
    async def Retry(self, request: pb.RetryRequest, context: Any) -> pb.RetryResponse:
        caller, session_id = await self._session(context, request.session_id)
        body: dict[str, Any] = {"seq": request.seq}
        if request.request_id:
            body["requestId"] = request.request_id
        committed = await inputs.retry(self._gateway, caller, session_id, body)
        return pb.RetryResponse(**_committed(committed))

    @_unary
    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: Any
    ) -> pb.ForkSessionResponse:
        caller, session_id = await self._session(context, request.session_id)
        body: dict[str, Any] = {"at": request.at_seq}
        if request.new_session_id:
            body["id"] = request.new_session_id
        forked = await forks.fork(self._gateway, caller, session_id, body)
        return pb.ForkSessionResponse(session_id=forked.session_id, head_seq=forked.head_seq)

    @_unary
    async def EditInput(self, request: pb.EditInputRequest, context: Any) -> pb.EditInputResponse:
        caller, session_id = await self._session(context, request.session_id)
        body: dict[str, Any] = {"seq": request.seq, "text": request.text}
        if request.request_id:
            body["requestId"] = request.request_id
        forked = await forks.edit(self._gateway, caller, session_id, body)
        assert forked.input is not None
        return pb.EditInputResponse(
            session_id=forked.session_id, input=pb.SendInputResponse(**_committed(forked.input))
        )

    @_unary
    async def CreateSchedule(
        self, request: pb.CreateScheduleRequest, context: Any
    ) -> pb.CreateScheduleResponse:
        caller, session_id = await self._session(context, request.session_id)
        body: dict[str, Any] = {"text": request.text}
        if request.cron:
            body["cron"] = request.cron
            body["timezone"] = request.timezone or "UTC"
        if request.at_ms:
            body["at"] = schedules.rfc3339(request.at_ms)
        made = await schedules.create(self._gateway, caller, session_id, body)
        return pb.CreateScheduleResponse(schedule=_schedule(made))

    @_unary
    async def ListSchedules(
        self, request: pb.ListSchedulesRequest, context: Any
    ) -> pb.ListSchedulesResponse:
        caller, session_id = await self._session(context, request.session_id)
        found = await schedules.listed(self._gateway, caller, session_id)
        return pb.ListSchedulesResponse(schedules=[_schedule(s) for s in found])

    @_unary
    async def DeleteSchedule(
        self, request: pb.DeleteScheduleRequest, context: Any
    ) -> pb.DeleteScheduleResponse:
        caller, session_id = await self._session(context, request.session_id)
        await schedules.delete(self._gateway, caller, session_id, request.schedule_id)
        return pb.DeleteScheduleResponse()

    @_unary
    async def SkipInputs(
        self, request: pb.SkipInputsRequest, context: Any
    ) -> pb.SkipInputsResponse:
        caller, session_id = await self._session(context, request.session_id)
        skipped = await inputs.skip(self._gateway, caller, session_id)
        return pb.SkipInputsResponse(seq=skipped.seq, skipped_input_seqs=skipped.input_seqs)

    @_unary
    async def Cancel(self, request: pb.CancelRequest, context: Any) -> pb.CancelResponse:
        caller, session_id = await self._session(context, request.session_id)
        cancelled = await inputs.cancel(self._gateway, caller, session_id)
        if cancelled is None:
            return pb.CancelResponse(cancelled=False)
        return pb.CancelResponse(cancelled=True, seq=cancelled.seq, input_seqs=cancelled.input_seqs)

    @_unary
    async def DecideApproval(
        self, request: pb.DecideApprovalRequest, context: Any
    ) -> pb.DecideApprovalResponse:
        caller, session_id = await self._session(context, request.session_id)
        body: dict[str, Any] = {"toolCallId": request.tool_call_id}
        # proto3 `optional`: an absent decision is a refusal, not a denial.
        if request.HasField("approve"):
            body["approve"] = request.approve
        if request.note:
            body["note"] = request.note
        decided = await approvals.decide(self._gateway, caller, session_id, body)
        return pb.DecideApprovalResponse(seq=decided.seq, by=decided.by)

    @_streaming
    async def StreamEvents(  # type: ignore[override]  # also yields serialized messages
        self, request: pb.StreamEventsRequest, context: Any
    ) -> AsyncIterator[pb.StreamEventsResponse | bytes]:
        caller, session_id = await self._session(context, request.session_id)
        # Registered at once: a revocation of the key from now on ends it.
        with self._gateway.auth.open_stream(caller) as open_stream:
            open_stream.check()
            # Counted with the SSE streams, before the ledger is asked anything.
            slot = self._guards.streams.acquire(caller)
            try:
                await self._gateway.check_cursor(caller, session_id, request.after_seq)
                # Headers now, as HTTP's 200: the caller knows the stream is
                # accepted before the session has anything to send.
                await context.send_initial_metadata(())
                follow = self._gateway.fanout.follow_frames(session_id, request.after_seq)
                try:
                    while (batch := await open_stream.next(follow)) is not None:
                        for frame in batch:
                            event = frame.grpc
                            if event is not None:
                                # Not one more frame once the key is revoked.
                                open_stream.check()
                                yield event
                        if isinstance(batch[-1].item, Drain):
                            retry = self._gateway.config.drain_retry_after_ms
                            yield pb.StreamEventsResponse(drain=pb.Drain(retry_after_ms=retry))
                            return
                finally:
                    await follow.aclose()
            finally:
                slot.release()

    @_unary
    async def GetContext(
        self, request: pb.GetContextRequest, context: Any
    ) -> pb.GetContextResponse:
        caller, session_id = await self._session(context, request.session_id)
        # 0 is proto3's "not given": the head, as an absent `at` over HTTP.
        at = request.at_seq if request.at_seq != 0 else None
        built = await self._gateway.context(caller, session_id, at)
        return pb.GetContextResponse(
            at_seq=built["at"],
            system_prompt=built["systemPrompt"],
            messages_json=_json(built["messages"]),
            compaction_seq=built["compactionSeq"],
            loadout_revision=built["loadoutRevision"],
            watermark=built["watermark"],
            estimated_tokens=built["estimatedTokens"],
        )

    @_unary
    async def GetLoadout(
        self, request: pb.GetLoadoutRequest, context: Any
    ) -> pb.GetLoadoutResponse:
        caller = await self._caller(context)
        revision, document = await admin_ops.get_loadout(self._gateway, caller)
        return pb.GetLoadoutResponse(revision=revision, document_json=_json(document))

    @_unary
    async def PutLoadout(
        self, request: pb.PutLoadoutRequest, context: Any
    ) -> pb.PutLoadoutResponse:
        caller = await self._caller(context)
        try:
            document = json.loads(request.document_json)
        except ValueError:
            raise BadRequest("document_json is not valid JSON", field="document_json") from None
        revision = await admin_ops.put_loadout(
            self._gateway, caller, document, request.expected_revision
        )
        return pb.PutLoadoutResponse(revision=revision)


def _schedule(schedule: Schedule) -> pb.Schedule:
    return pb.Schedule(
        schedule_id=schedule.schedule_id,
        text=schedule.text,
        cron=schedule.cron,
        timezone=schedule.timezone,
        at_ms=schedule.at_ms,
        next_fire_ms=schedule.next_fire_ms,
        created_at_ms=schedule.created_at_ms,
    )


def _committed(committed: Committed) -> dict[str, Any]:
    return {
        "seq": committed.seq,
        "duplicate": committed.duplicate,
        "request_id": committed.request_id,
        "retry_safe": committed.retry_safe,
    }


class MalformedRequest(BadRequest):
    """The request's bytes are not its message (bad wire format, a string
    that is not UTF-8): refused like any bad field, not as a bug."""

    reason = "MALFORMED_REQUEST"


async def _decoded(
    request_type: Any, raw: bytes, limit: int, context: grpc.aio.ServicerContext[Any, Any], rpc: str
) -> Any:
    """The request in `raw`; bytes over the edge's request limit (the same
    as HTTP's body limit) or not a `request_type` are refused by name."""
    name = request_type.DESCRIPTOR.name
    if len(raw) > limit:
        await _abort(context, too_large(limit, f"the {name}"), rpc)
    try:
        return request_type.FromString(raw)
    except DecodeError:
        await _abort(context, MalformedRequest(f"the request is not a valid {name}"), rpc)


def _method_handler(servicer: SessionServicer, method: Any) -> grpc.RpcMethodHandler[Any, Any]:
    """One RPC that decodes its own request, so bytes that are not its
    message get INVALID_ARGUMENT (gRPC's own decoding answers UNKNOWN)."""
    request_type = getattr(pb, method.input_type.name)
    response_type = getattr(pb, method.output_type.name)
    bound = getattr(servicer, method.name)
    limit = servicer.max_request_bytes

    if method.server_streaming:

        async def stream(raw: bytes, context: Any) -> AsyncIterator[Any]:
            request = await _decoded(request_type, raw, limit, context, method.name)
            async for item in bound(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(stream, response_serializer=_serialized)

    async def unary(raw: bytes, context: Any) -> Any:
        request = await _decoded(request_type, raw, limit, context, method.name)
        return await bound(request, context)

    return grpc.unary_unary_rpc_method_handler(
        unary, response_serializer=response_type.SerializeToString
    )


def _serialized(message: Any) -> bytes:
    """A streamed message, or one serialized already (a shared frame)."""
    if isinstance(message, bytes):
        return message
    data: bytes = message.SerializeToString()
    return data


def _add_to_server(servicer: SessionServicer, server: grpc.aio.Server) -> None:
    methods = pb.DESCRIPTOR.services_by_name["SessionService"].methods
    handlers = {m.name: _method_handler(servicer, m) for m in methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def session_service(gateway: Gateway, guards: Guards | None = None) -> GrpcService:
    """The service on `gateway`; `guards` are shared with the HTTP app of the
    same edge (else this service's own)."""
    servicer = SessionServicer(gateway, guards or Guards.of())
    return GrpcService(
        name=SERVICE_NAME, add_to_server=lambda server: _add_to_server(servicer, server)
    )
