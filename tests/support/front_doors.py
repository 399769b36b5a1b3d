"""The edge's two front doors behind one small interface, for scenario tables
that must hold over both: HTTP (httpx, SSE read with the CLI's parser) and
gRPC (keel.sessions.v1 through its generated stub, nothing in between).

A refusal is `Refused` with a transport-neutral `outcome` (the row's
expectation) plus what the transport said: the HTTP error code or the
gRPC ErrorInfo reason, and the field it named, if any.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import httpx
from grpc.aio import EOF  # type: ignore[attr-defined]

from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from services.cli.chat_view import SseParser
from services.common.errors import error_info

DEADLINE_S = 30.0
# outcome -> (HTTP status, gRPC code): what "the same outcome" means per door.
OUTCOMES: dict[str, tuple[int, grpc.StatusCode]] = {
    "unauthenticated": (401, grpc.StatusCode.UNAUTHENTICATED),
    "permission_denied": (403, grpc.StatusCode.PERMISSION_DENIED),
    "not_found": (404, grpc.StatusCode.NOT_FOUND),
    "invalid_argument": (400, grpc.StatusCode.INVALID_ARGUMENT),
    "conflict": (409, grpc.StatusCode.ALREADY_EXISTS),
    "failed_precondition": (412, grpc.StatusCode.FAILED_PRECONDITION),
    "unavailable": (503, grpc.StatusCode.UNAVAILABLE),
}


class Refused(Exception):
    def __init__(self, outcome: str, reason: str, message: str, field: str | None) -> None:
        super().__init__(f"{outcome} ({reason}): {message}")
        self.outcome = outcome
        # HTTP: the JSON error code; gRPC: the ErrorInfo reason.
        self.reason = reason
        self.message = message
        self.field = field


@dataclass(frozen=True)
class Sent:
    """An input (or retry) as committed."""

    seq: int
    duplicate: bool
    request_id: str


@dataclass(frozen=True)
class Event:
    """A stream event: a fact (with its seq) or a delta/status/drain (without)."""

    type: str  # fact, delta, status or drain
    seq: int | None
    kind: str
    data: dict[str, Any]


@dataclass(frozen=True)
class SessionState:
    head_seq: int
    status: str
    owed_inputs: tuple[int, ...]
    parked_on: tuple[int, ...] = ()
    parked_reason: str = ""


class EventStream(Protocol):
    async def next(self, deadline_s: float = DEADLINE_S) -> Event | None:
        """The next event; None when the edge ended the stream."""

    async def close(self) -> None: ...


class FrontDoor(Protocol):
    name: str

    def with_key(self, key: str | None) -> FrontDoor:
        """The same door for another key (None: no key at all)."""

    async def close(self) -> None: ...
    async def create_session(self, session_id: str | None = None) -> str: ...
    async def send_input(
        self, session: str, text: str, request_id: str | None = None, multitask: str | None = None
    ) -> Sent: ...
    async def events(self, session: str, after: int) -> EventStream:
        """An open stream of facts after `after` (refusals raise here)."""

    async def retry(self, session: str, seq: int, request_id: str | None = None) -> Sent: ...
    async def skip(self, session: str) -> tuple[int, tuple[int, ...]]:
        """The skip's seq and the inputs it settled."""
        ...

    async def cancel_naming(self, session: str) -> tuple[int | None, tuple[int, ...]]:
        """The cancel's seq (None: nothing to cancel) and the inputs it settles."""
        ...

    async def fork(self, session: str, at: int) -> str:
        """The fork's id."""
        ...

    async def schedule(
        self, session: str, text: str, *, cron: str = "", timezone: str = "", at_ms: int = 0
    ) -> str:
        """The schedule's id."""
        ...

    async def schedules(self, session: str) -> list[str]:
        """The session's schedules' ids."""
        ...

    async def unschedule(self, session: str, schedule_id: str) -> None: ...

    async def edit(self, session: str, seq: int, text: str) -> tuple[str, int]:
        """The fork's id and the edited input's seq."""
        ...

    async def cancel(self, session: str) -> int | None:
        """The cancel's seq, None when nothing was cancelled."""

    async def get_session(self, session: str) -> SessionState: ...
    async def get_context(self, session: str, at: int | None = None) -> dict[str, Any]: ...
    async def get_loadout(self) -> tuple[int, dict[str, Any]]:
        """The tenant's loadout: (revision, document)."""

    async def put_loadout(self, document: Any, expected_revision: int = 0) -> int: ...


def outcome_of_http(status: int) -> str:
    for outcome, (http_status, _) in OUTCOMES.items():
        if http_status == status:
            return outcome
    return f"http {status}"


def outcome_of_grpc(code: grpc.StatusCode) -> str:
    for outcome, (_, grpc_code) in OUTCOMES.items():
        if grpc_code == code:
            return outcome
    return f"grpc {code.name}"


# ------------------------------------------------------------------ HTTP


def _http_refused(response: httpx.Response) -> Refused:
    error = response.json()["error"]
    return Refused(outcome_of_http(response.status_code), error["code"], error["message"], None)


class SseStream:
    def __init__(self, context: Any, response: httpx.Response) -> None:
        self._context = context
        self._lines = response.aiter_lines()
        self._parser = SseParser()

    async def next(self, deadline_s: float = DEADLINE_S) -> Event | None:
        async def one() -> Event | None:
            async for line in self._lines:
                sse = self._parser.feed(line)
                if sse is None:
                    continue
                data = json.loads(sse.data)
                if sse.id is not None:
                    return Event("fact", int(sse.id), sse.event, data["data"])
                return Event(sse.event, None, sse.event, data)
            return None

        return await asyncio.wait_for(one(), deadline_s)

    async def close(self) -> None:
        await self._context.__aexit__(None, None, None)


class HttpDoor:
    name = "http"

    def __init__(self, url: str, key: str | None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        self._url = url
        self._http = httpx.AsyncClient(
            base_url=url, headers=headers, timeout=httpx.Timeout(DEADLINE_S)
        )
        self._others: list[HttpDoor] = []

    def with_key(self, key: str | None) -> HttpDoor:
        other = HttpDoor(self._url, key)
        self._others.append(other)
        return other

    async def close(self) -> None:
        for other in self._others:
            await other.close()
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = await self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise _http_refused(response)
        return response

    async def create_session(self, session_id: str | None = None) -> str:
        body = {"id": session_id} if session_id is not None else {}
        created: str = (await self._call("POST", "/v1/sessions", json=body)).json()["id"]
        return created

    def _sent(self, response: httpx.Response) -> Sent:
        body = response.json()
        return Sent(body["seq"], response.status_code == 200, body["requestId"])

    async def send_input(
        self, session: str, text: str, request_id: str | None = None, multitask: str | None = None
    ) -> Sent:
        body: dict[str, Any] = {"text": text}
        if request_id is not None:
            body["requestId"] = request_id
        if multitask is not None:
            body["multitask"] = multitask
        return self._sent(await self._call("POST", f"/v1/sessions/{session}/inputs", json=body))

    async def retry(self, session: str, seq: int, request_id: str | None = None) -> Sent:
        body: dict[str, Any] = {"seq": seq}
        if request_id is not None:
            body["requestId"] = request_id
        return self._sent(await self._call("POST", f"/v1/sessions/{session}/retry", json=body))

    async def cancel(self, session: str) -> int | None:
        return (await self.cancel_naming(session))[0]

    async def cancel_naming(self, session: str) -> tuple[int | None, tuple[int, ...]]:
        body = (await self._call("POST", f"/v1/sessions/{session}/cancel")).json()
        if not body["cancelled"]:
            return None, ()
        return body["seq"], tuple(body["inputSeqs"])

    async def skip(self, session: str) -> tuple[int, tuple[int, ...]]:
        body = (await self._call("POST", f"/v1/sessions/{session}/skip")).json()
        return body["seq"], tuple(body["skipped"])

    async def schedule(
        self, session: str, text: str, *, cron: str = "", timezone: str = "", at_ms: int = 0
    ) -> str:
        body: dict[str, Any] = {"text": text}
        if cron:
            body.update({"cron": cron, "timezone": timezone or "UTC"})
        if at_ms:
            moment = datetime.datetime.fromtimestamp(at_ms / 1000, tz=datetime.UTC)
            body["at"] = moment.isoformat(timespec="milliseconds")
        made = await self._call("POST", f"/v1/sessions/{session}/schedules", json=body)
        schedule_id: str = made.json()["id"]
        return schedule_id

    async def schedules(self, session: str) -> list[str]:
        listed = (await self._call("GET", f"/v1/sessions/{session}/schedules")).json()
        return [s["id"] for s in listed["schedules"]]

    async def unschedule(self, session: str, schedule_id: str) -> None:
        await self._call("DELETE", f"/v1/sessions/{session}/schedules/{schedule_id}")

    async def fork(self, session: str, at: int) -> str:
        body = (await self._call("POST", f"/v1/sessions/{session}/fork", json={"at": at})).json()
        fork_id: str = body["id"]
        return fork_id

    async def edit(self, session: str, seq: int, text: str) -> tuple[str, int]:
        response = await self._call(
            "POST", f"/v1/sessions/{session}/edit", json={"seq": seq, "text": text}
        )
        body = response.json()
        return body["id"], body["input"]["seq"]

    async def events(self, session: str, after: int) -> SseStream:
        context = self._http.stream(
            "GET",
            f"/v1/sessions/{session}/events",
            params={"after": str(after)},
            headers={"Accept": "text/event-stream"},
        )
        response = await context.__aenter__()
        if response.status_code != 200:
            await response.aread()
            await context.__aexit__(None, None, None)
            raise _http_refused(response)
        return SseStream(context, response)

    async def get_session(self, session: str) -> SessionState:
        body = (await self._call("GET", f"/v1/sessions/{session}")).json()
        return SessionState(
            body["headSeq"],
            body["status"],
            tuple(body["owedInputs"]),
            tuple(body.get("parkedOn", ())),
            body.get("parkedReason", ""),
        )

    async def get_context(self, session: str, at: int | None = None) -> dict[str, Any]:
        params = {"at": str(at)} if at is not None else {}
        built: dict[str, Any] = (
            await self._call("GET", f"/v1/sessions/{session}/context", params=params)
        ).json()
        return built

    async def get_loadout(self) -> tuple[int, dict[str, Any]]:
        body = (await self._call("GET", "/v1/loadout")).json()
        return body["revision"], body["document"]

    async def put_loadout(self, document: Any, expected_revision: int = 0) -> int:
        headers = {"If-Match": f'"{expected_revision}"'} if expected_revision else {}
        response = await self._call("PUT", "/v1/loadout", json=document, headers=headers)
        revision: int = response.json()["revision"]
        return revision


# ------------------------------------------------------------------ gRPC


def delta_fields(delta: pb.Delta) -> dict[str, Any]:
    """A gRPC delta's fields under the names an SSE delta frame gives them."""
    return {
        "generationId": delta.generation_id,
        "epoch": delta.epoch,
        "attemptId": delta.attempt_id,
        "channel": delta.channel,
        "text": delta.text,
        "toolCallId": delta.tool_call_id,
        "toolName": delta.tool_name,
    }


def _grpc_refused(err: grpc.aio.AioRpcError) -> Refused:
    info = error_info(err)
    reason = info.reason if info is not None else ""
    field = info.metadata.get("field") if info is not None else None
    return Refused(outcome_of_grpc(err.code()), reason, err.details() or "", field)


class GrpcStream:
    def __init__(self, call: Any) -> None:
        self._call = call

    @staticmethod
    def _event(message: pb.StreamEventsResponse) -> Event:
        which = message.WhichOneof("event")
        if which == "fact":
            fact = message.fact
            return Event("fact", fact.seq, fact.kind, json.loads(fact.data_json))
        if which == "delta":
            return Event("delta", None, "delta", delta_fields(message.delta))
        if which == "status":
            return Event("status", None, "status", {"state": message.status.state})
        assert which == "drain", which
        return Event("drain", None, "drain", {"retry_after_ms": message.drain.retry_after_ms})

    async def next(self, deadline_s: float = DEADLINE_S) -> Event | None:
        try:
            message = await asyncio.wait_for(self._call.read(), deadline_s)
        except grpc.aio.AioRpcError as err:
            raise _grpc_refused(err) from None
        if message is EOF:
            return None
        return self._event(message)

    async def close(self) -> None:
        self._call.cancel()


class GrpcDoor:
    name = "grpc"

    def __init__(self, address: str, key: str | None) -> None:
        self._address = address
        self._metadata = (("authorization", f"Bearer {key}"),) if key is not None else ()
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.SessionServiceStub(self._channel)
        self._others: list[GrpcDoor] = []

    def with_key(self, key: str | None) -> GrpcDoor:
        other = GrpcDoor(self._address, key)
        self._others.append(other)
        return other

    async def close(self) -> None:
        for other in self._others:
            await other.close()
        await self._channel.close(None)

    async def _call(self, rpc: Any, request: Any) -> Any:
        try:
            return await rpc(request, metadata=self._metadata, timeout=DEADLINE_S)
        except grpc.aio.AioRpcError as err:
            raise _grpc_refused(err) from None

    async def create_session(self, session_id: str | None = None) -> str:
        request = pb.CreateSessionRequest(session_id=session_id or "")
        created: str = (await self._call(self._stub.CreateSession, request)).session_id
        return created

    async def send_input(
        self, session: str, text: str, request_id: str | None = None, multitask: str | None = None
    ) -> Sent:
        request = pb.SendInputRequest(
            session_id=session, text=text, request_id=request_id or "", multitask=multitask or ""
        )
        sent = await self._call(self._stub.SendInput, request)
        return Sent(sent.seq, sent.duplicate, sent.request_id)

    async def retry(self, session: str, seq: int, request_id: str | None = None) -> Sent:
        request = pb.RetryRequest(session_id=session, seq=seq, request_id=request_id or "")
        sent = await self._call(self._stub.Retry, request)
        return Sent(sent.seq, sent.duplicate, sent.request_id)

    async def cancel(self, session: str) -> int | None:
        return (await self.cancel_naming(session))[0]

    async def cancel_naming(self, session: str) -> tuple[int | None, tuple[int, ...]]:
        done = await self._call(self._stub.Cancel, pb.CancelRequest(session_id=session))
        if not done.cancelled:
            return None, ()
        return int(done.seq), tuple(done.input_seqs)

    async def skip(self, session: str) -> tuple[int, tuple[int, ...]]:
        done = await self._call(self._stub.SkipInputs, pb.SkipInputsRequest(session_id=session))
        return int(done.seq), tuple(done.skipped_input_seqs)

    async def schedule(
        self, session: str, text: str, *, cron: str = "", timezone: str = "", at_ms: int = 0
    ) -> str:
        request = pb.CreateScheduleRequest(
            session_id=session, text=text, cron=cron, timezone=timezone, at_ms=at_ms
        )
        made = await self._call(self._stub.CreateSchedule, request)
        return str(made.schedule.schedule_id)

    async def schedules(self, session: str) -> list[str]:
        request = pb.ListSchedulesRequest(session_id=session)
        listed = await self._call(self._stub.ListSchedules, request)
        return [s.schedule_id for s in listed.schedules]

    async def unschedule(self, session: str, schedule_id: str) -> None:
        request = pb.DeleteScheduleRequest(session_id=session, schedule_id=schedule_id)
        await self._call(self._stub.DeleteSchedule, request)

    async def fork(self, session: str, at: int) -> str:
        request = pb.ForkSessionRequest(session_id=session, at_seq=at)
        return str((await self._call(self._stub.ForkSession, request)).session_id)

    async def edit(self, session: str, seq: int, text: str) -> tuple[str, int]:
        request = pb.EditInputRequest(session_id=session, seq=seq, text=text)
        done = await self._call(self._stub.EditInput, request)
        return str(done.session_id), int(done.input.seq)

    async def events(self, session: str, after: int) -> GrpcStream:
        call = self._stub.StreamEvents(
            pb.StreamEventsRequest(session_id=session, after_seq=after), metadata=self._metadata
        )
        # The edge sends headers once it accepts the stream; a refusal ends
        # the call instead (and is raised here, as HTTP's status is).
        await asyncio.wait_for(call.initial_metadata(), DEADLINE_S)
        if call.done() and await call.code() != grpc.StatusCode.OK:
            try:
                await call.read()
            except grpc.aio.AioRpcError as err:
                raise _grpc_refused(err) from None
        return GrpcStream(call)

    async def get_session(self, session: str) -> SessionState:
        got = await self._call(self._stub.GetSession, pb.GetSessionRequest(session_id=session))
        return SessionState(
            got.head_seq,
            got.status,
            tuple(got.owed_input_seqs),
            tuple(got.parked_on),
            got.parked_reason,
        )

    async def get_context(self, session: str, at: int | None = None) -> dict[str, Any]:
        request = pb.GetContextRequest(session_id=session, at_seq=at or 0)
        built = await self._call(self._stub.GetContext, request)
        return {
            "at": built.at_seq,
            "systemPrompt": built.system_prompt,
            "messages": json.loads(built.messages_json),
            "compactionSeq": built.compaction_seq,
            "loadoutRevision": built.loadout_revision,
            "watermark": built.watermark,
            "estimatedTokens": built.estimated_tokens,
        }

    async def get_loadout(self) -> tuple[int, dict[str, Any]]:
        got = await self._call(self._stub.GetLoadout, pb.GetLoadoutRequest())
        return got.revision, json.loads(got.document_json)

    async def put_loadout(self, document: Any, expected_revision: int = 0) -> int:
        request = pb.PutLoadoutRequest(
            document_json=json.dumps(document), expected_revision=expected_revision
        )
        revision: int = (await self._call(self._stub.PutLoadout, request)).revision
        return revision


async def stream_events(stream: EventStream) -> AsyncIterator[Event]:
    """The stream's events until the edge ends it."""
    while (event := await stream.next()) is not None:
        yield event
