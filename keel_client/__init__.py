"""The Python client of Keel's public gRPC API (`keel.sessions.v1.SessionService`).

Connect to an edge's gRPC address with an API key; results are frozen
dataclasses, failures are `KeelClientError` subclasses (one per reason), and
`events()` reconnects by itself, yielding every fact once, in order::

    import asyncio, os
    from keel_client import AsyncKeelClient, Fact

    async def main() -> None:
        async with AsyncKeelClient("127.0.0.1:8081", os.environ["KEEL_API_KEY"]) as keel:
            session = await keel.create_session()
            sent = await keel.send_input(session, "hello", request_id="hello-1")
            async for event in keel.events(session):  # facts, deltas, status changes
                if isinstance(event, Fact) and sent.seq in event.data.get("inputSeqs", ()):
                    print(event.data["content"][0]["text"])  # the committed answer
                    break

    asyncio.run(main())

`KeelClient` is the same API for code without asyncio (`with KeelClient(...)
as keel:`, plain iterators).
"""

from keel_client._async_client import AsyncKeelClient
from keel_client._config import ClientOptions, ReconnectPolicy
from keel_client._errors import (
    ApprovalAlreadyDecided,
    ApprovalNotPending,
    ClientClosed,
    Conflict,
    DeadlineExceeded,
    IdempotencyConflict,
    InvalidArgument,
    InvalidLoadout,
    KeelClientError,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ReconnectGaveUp,
    RevisionMismatch,
    SeqOutOfRange,
    ServerError,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    SessionNotParked,
    StreamOutOfOrder,
    Unauthenticated,
    Unavailable,
    error_from_rpc,
)
from keel_client._sync_client import KeelClient, SyncIterator
from keel_client._types import (
    Cancellation,
    Context,
    Decision,
    Delta,
    Event,
    Fact,
    Input,
    Loadout,
    PendingApproval,
    Schedule,
    Session,
    SessionPage,
    SessionSummary,
    Skip,
    Status,
)

__all__ = [
    "ApprovalAlreadyDecided",
    "ApprovalNotPending",
    "AsyncKeelClient",
    "Cancellation",
    "ClientClosed",
    "ClientOptions",
    "Conflict",
    "Context",
    "DeadlineExceeded",
    "Decision",
    "Delta",
    "Event",
    "Fact",
    "IdempotencyConflict",
    "Input",
    "InvalidArgument",
    "InvalidLoadout",
    "KeelClient",
    "KeelClientError",
    "Loadout",
    "NotFound",
    "PayloadTooLarge",
    "PendingApproval",
    "PermissionDenied",
    "ReconnectGaveUp",
    "ReconnectPolicy",
    "RevisionMismatch",
    "Schedule",
    "SeqOutOfRange",
    "ServerError",
    "Session",
    "SessionBusy",
    "SessionExists",
    "SessionNotFound",
    "SessionNotParked",
    "SessionPage",
    "SessionSummary",
    "Skip",
    "Status",
    "StreamOutOfOrder",
    "SyncIterator",
    "Unauthenticated",
    "Unavailable",
    "error_from_rpc",
]
