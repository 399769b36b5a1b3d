"""`AsyncKeelClient`: the asyncio client of `keel.sessions.v1.SessionService`."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from keel_client._config import ClientOptions
from keel_client._errors import ClientClosed, error_from_rpc
from keel_client._events import follow_session
from keel_client._types import (
    Cancellation,
    Context,
    Decision,
    Event,
    Input,
    Loadout,
    Schedule,
    Session,
    SessionPage,
    SessionSummary,
    Skip,
)

Response = TypeVar("Response")


def open_channel(address: str, options: ClientOptions) -> grpc.aio.Channel:
    if options.tls:
        credentials = grpc.ssl_channel_credentials(options.root_certificates)
        return grpc.aio.secure_channel(address, credentials, options=options.channel_options())
    return grpc.aio.insecure_channel(address, options=options.channel_options())


class AsyncKeelClient:
    """A connection to a Keel edge's gRPC API, acting with one API key.

    `address` is the edge's gRPC `host:port` (what `keel up` prints as
    "gRPC API"). Calls raise `KeelClientError` subclasses, never
    `grpc.RpcError`. Use as `async with AsyncKeelClient(...) as keel:` or
    call `close()`.
    """

    def __init__(self, address: str, key: str, *, options: ClientOptions | None = None) -> None:
        if not address:
            raise ValueError("address is the edge's gRPC host:port")
        if not key:
            raise ValueError("key is an API key of a tenant")
        self.address = address
        self.options = options or ClientOptions()
        self._channel = open_channel(address, self.options)
        self._stub: pb_grpc.SessionServiceAsyncStub = pb_grpc.SessionServiceStub(self._channel)
        self._metadata: Sequence[tuple[str, str]] = (("authorization", f"Bearer {key}"),)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Closes the connection; waiting calls and iterators end with `ClientClosed`."""
        self._closed = True
        await self._channel.close(None)

    async def __aenter__(self) -> AsyncKeelClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Awaitable[Response]], request: Any) -> Response:
        if self._closed:
            raise ClientClosed("the client is closed")
        try:
            return await method(request, metadata=self._metadata, timeout=self.options.timeout_s)
        except grpc.aio.AioRpcError as err:
            if self._closed:
                raise ClientClosed("the client was closed during the call") from None
            raise error_from_rpc(err) from None

    # ------------------------------------------------------------ sessions

    async def create_session(self, session_id: str | None = None) -> str:
        """A new session of the key's tenant (the edge names it if you don't)."""
        request = pb.CreateSessionRequest(session_id=session_id or "")
        return (await self._call(self._stub.CreateSession, request)).session_id

    async def get_session(self, session_id: str) -> Session:
        request = pb.GetSessionRequest(session_id=session_id)
        return Session.from_pb(await self._call(self._stub.GetSession, request))

    async def list_sessions(self, page_size: int = 0, page_token: str = "") -> SessionPage:
        """One page of the tenant's sessions, ascending by id (0: the server's page size)."""
        request = pb.ListSessionsRequest(page_size=page_size, page_token=page_token)
        return SessionPage.from_pb(await self._call(self._stub.ListSessions, request))

    async def iter_sessions(self, page_size: int = 0) -> AsyncGenerator[SessionSummary, None]:
        """Every session of the tenant, fetching pages as it goes."""
        token = ""
        while True:
            page = await self.list_sessions(page_size, token)
            for summary in page.sessions:
                yield summary
            if not page.next_page_token:
                return
            token = page.next_page_token

    # ------------------------------------------------------------ inputs

    async def send_input(
        self,
        session_id: str,
        text: str,
        request_id: str | None = None,
        blob_ids: Sequence[str] = (),
        multitask: str | None = None,
    ) -> Input:
        """Commits an input. With a `request_id` the call is safe to repeat:
        the same id and body give the same seq (`duplicate=True`); the same
        id with another body raises `IdempotencyConflict`. `multitask` says
        what it asks of work under way ("enqueue", "reject" — `SessionBusy`
        while work is owed —, "interrupt", "rollback"; None: the tenant's)."""
        request = pb.SendInputRequest(
            session_id=session_id,
            text=text,
            request_id=request_id or "",
            blob_ids=list(blob_ids),
            multitask=multitask or "",
        )
        return Input.from_pb(await self._call(self._stub.SendInput, request))

    async def cancel(self, session_id: str) -> Cancellation:
        response = await self._call(self._stub.Cancel, pb.CancelRequest(session_id=session_id))
        return Cancellation(
            cancelled=response.cancelled, seq=response.seq, input_seqs=tuple(response.input_seqs)
        )

    async def fork_session(self, session_id: str, at_seq: int, new_session_id: str = "") -> str:
        """A new session whose history is this one's facts 1..`at_seq` (then
        a `forked_from` fact); it goes on on its own. The fork's id."""
        request = pb.ForkSessionRequest(
            session_id=session_id, at_seq=at_seq, new_session_id=new_session_id
        )
        return (await self._call(self._stub.ForkSession, request)).session_id

    async def edit_input(
        self, session_id: str, seq: int, text: str, request_id: str | None = None
    ) -> tuple[str, Input]:
        """Edit and resend: a fork before input `seq` whose next input is
        `text`. The fork's id and the edited input."""
        request = pb.EditInputRequest(
            session_id=session_id, seq=seq, text=text, request_id=request_id or ""
        )
        response = await self._call(self._stub.EditInput, request)
        return response.session_id, Input.from_pb(response.input)

    async def create_schedule(
        self,
        session_id: str,
        text: str,
        *,
        cron: str = "",
        timezone: str = "UTC",
        at_ms: int = 0,
    ) -> Schedule:
        """An input `text` sent on `cron` (read in `timezone`) or once at
        `at_ms`; each firing is committed once, whatever fails meanwhile."""
        request = pb.CreateScheduleRequest(
            session_id=session_id, text=text, cron=cron, timezone=timezone, at_ms=at_ms
        )
        response = await self._call(self._stub.CreateSchedule, request)
        return Schedule.from_pb(response.schedule)

    async def list_schedules(self, session_id: str) -> list[Schedule]:
        request = pb.ListSchedulesRequest(session_id=session_id)
        response = await self._call(self._stub.ListSchedules, request)
        return [Schedule.from_pb(s) for s in response.schedules]

    async def delete_schedule(self, session_id: str, schedule_id: str) -> None:
        """`NotFound` when the session has no such schedule."""
        request = pb.DeleteScheduleRequest(session_id=session_id, schedule_id=schedule_id)
        await self._call(self._stub.DeleteSchedule, request)

    async def skip_inputs(self, session_id: str) -> Skip:
        """Settles the inputs a parked session failed on (`Session.parked_on`),
        and only those: the model is told they were skipped and why, and the
        inputs sent after them are answered. `SessionNotParked` when the
        session is not parked on a failed input."""
        request = pb.SkipInputsRequest(session_id=session_id)
        response = await self._call(self._stub.SkipInputs, request)
        return Skip(seq=response.seq, skipped_input_seqs=tuple(response.skipped_input_seqs))

    async def retry(self, session_id: str, seq: int, request_id: str | None = None) -> Input:
        """Asks the input at `seq` again, as a new input (deduplicated like send_input)."""
        request = pb.RetryRequest(session_id=session_id, seq=seq, request_id=request_id or "")
        return Input.from_pb(await self._call(self._stub.Retry, request))

    async def decide_approval(
        self, session_id: str, tool_call_id: str, approve: bool, note: str | None = None
    ) -> Decision:
        """Decides a tool call waiting for approval (`Session.pending_approvals`):
        approved, the call runs; denied, the model gets an error result with
        the note. One decision per call: `ApprovalNotPending` for a call that
        does not wait, `ApprovalAlreadyDecided` for a second decision."""
        request = pb.DecideApprovalRequest(
            session_id=session_id, tool_call_id=tool_call_id, approve=approve, note=note or ""
        )
        response = await self._call(self._stub.DecideApproval, request)
        return Decision(seq=response.seq, by=response.by)

    # ------------------------------------------------------------ reading

    def events(self, session_id: str, after: int = 0) -> AsyncGenerator[Event, None]:
        """The session's facts after seq `after`, with deltas and status
        changes, for as long as the caller iterates; reconnects by itself
        (see `ReconnectPolicy`). Close it with `aclose()` or by leaving an
        `async for` loop."""
        return follow_session(
            self._stub,
            session_id,
            after,
            self._metadata,
            self.options.reconnect,
            lambda: self._closed,
        )

    async def get_context(self, session_id: str, at_seq: int = 0) -> Context:
        """What a model request built at `at_seq` (0: the head) presented."""
        request = pb.GetContextRequest(session_id=session_id, at_seq=at_seq)
        return Context.from_pb(await self._call(self._stub.GetContext, request))

    # ------------------------------------------------------------ loadout

    async def get_loadout(self) -> Loadout:
        """The tenant's current loadout (needs an admin key)."""
        return Loadout.from_pb(await self._call(self._stub.GetLoadout, pb.GetLoadoutRequest()))

    async def put_loadout(self, document: Mapping[str, Any], expected_revision: int = 0) -> int:
        """Stores `document` as the tenant's next loadout revision and returns
        it. With `expected_revision`, only if that is still the current one
        (else `RevisionMismatch`); a refused document raises `InvalidLoadout`
        naming the field."""
        request = pb.PutLoadoutRequest(
            document_json=json.dumps(document, ensure_ascii=False),
            expected_revision=expected_revision,
        )
        return (await self._call(self._stub.PutLoadout, request)).revision
