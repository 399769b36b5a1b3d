"""`LedgerClient`: the typed async client other services use.

Errors come back as the ledger's own exception classes (`StaleEpoch`,
`IdempotencyConflict`, …), so callers never inspect status codes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keel.ledger.v1 import ledger_pb2 as pb
from keel.ledger.v1 import ledger_pb2_grpc as pb_grpc
from services.common.config import Settings
from services.common.rpc import balanced_target, replica_channel_options, streaming, unary
from services.common.serving import MESSAGE_OVERHEAD_BYTES, open_channel
from services.ledger.append_stream import AppendPipeline
from services.ledger.codec import fact_from_pb, new_fact_to_pb, settlement_to_pb, view_from_pb
from services.ledger.errors import LedgerError
from services.ledger.facts import CommittedFact
from services.ledger.packed_facts import MAX_PACKED_READ_LIMIT, facts_from_packed
from services.ledger.views import Appended, SessionView, Settlement

# Safe to resend to another replica after UNAVAILABLE. Appends are left to
# the callers: only some facts carry a dedup key.
_READ_ONLY_METHODS = ("Read", "Subscribe", "GetSession", "ListSessions")


@dataclass(frozen=True)
class FactToAppend:
    kind: str
    data: Mapping[str, Any]


@dataclass(frozen=True)
class SessionPage:
    sessions: list[pb.SessionSummary]
    # Where the next page starts; "" when the listing is complete.
    next_after: str


def _append_request(
    session_id: str, facts: Sequence[FactToAppend], epoch: int, only_if_idle: bool = False
) -> pb.AppendRequest:
    return pb.AppendRequest(
        session_id=session_id,
        epoch=epoch,
        facts=[new_fact_to_pb(f.kind, f.data) for f in facts],
        only_if_idle=only_if_idle,
    )


class LedgerClient:
    """Async client of `keel.ledger.v1.LedgerService`."""

    def __init__(self, target: str, settings: Settings | None = None) -> None:
        # `target` may list ledger replicas ("host:port,host:port").
        settings = settings or Settings()
        self._channel = open_channel(
            balanced_target(target),
            settings,
            replica_channel_options("keel.ledger.v1.LedgerService", _READ_ONLY_METHODS),
        )
        self._stub = pb_grpc.LedgerServiceStub(self._channel)
        # What a packed page may take of a received message.
        self._max_packed_bytes = settings.grpc_max_message_bytes - MESSAGE_OVERHEAD_BYTES
        # Opened on the first append, shared by every task of the process.
        self._appends = AppendPipeline(self._stub.AppendStream)

    async def close(self) -> None:
        await self._appends.close()
        await self._channel.close(None)

    async def __aenter__(self) -> LedgerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create_session(self, session_id: str, tenant_id: str) -> bool:
        request = pb.CreateSessionRequest(session_id=session_id, tenant_id=tenant_id)
        response = await unary(self._stub.CreateSession(request), LedgerError)
        return response.created

    async def append(
        self,
        session_id: str,
        facts: Sequence[FactToAppend],
        epoch: int = 0,
        *,
        only_if_idle: bool = False,
    ) -> list[Appended]:
        """Appends `facts` atomically over the client's AppendStream;
        `only_if_idle`: only while the session owes nothing (SessionBusy).

        Raises what the unary `Append` would (StaleEpoch, InvalidFact, …);
        ServiceUnavailable when the stream failed before the answer came, in
        which case the append may or may not have committed."""
        request = _append_request(session_id, facts, epoch, only_if_idle)
        response = await self._appends.append(request)
        return [Appended(r.seq, r.duplicate) for r in response.results]

    async def fork_session(self, parent_id: str, session_id: str, at_seq: int) -> int:
        """Creates `session_id` from `parent_id`'s facts 1..`at_seq` and a
        `forked_from` fact; returns the fork's head (at_seq + 1)."""
        request = pb.ForkSessionRequest(
            parent_session_id=parent_id, session_id=session_id, at_seq=at_seq
        )
        response = await unary(self._stub.ForkSession(request), LedgerError)
        return response.head_seq

    async def append_unary(
        self, session_id: str, facts: Sequence[FactToAppend], epoch: int = 0
    ) -> list[Appended]:
        """`append` as one unary `Append` call, for callers without a stream."""
        request = _append_request(session_id, facts, epoch)
        response = await unary(self._stub.Append(request), LedgerError)
        return [Appended(r.seq, r.duplicate) for r in response.results]

    async def append_one(
        self, session_id: str, kind: str, data: Mapping[str, Any], epoch: int = 0
    ) -> Appended:
        return (await self.append(session_id, [FactToAppend(kind, data)], epoch))[0]

    async def append_settling(
        self, session_id: str, kind: str, data: Mapping[str, Any], epoch: int, settle: Settlement
    ) -> tuple[Appended, int]:
        """Appends an attempt's last fact with its Finish (`settle`) for the
        ledger to settle in the same transaction where it can; also returns
        the end of the sticky window granted, or 0 when nothing was settled
        (the caller then sends its Finish)."""
        request = _append_request(session_id, [FactToAppend(kind, data)], epoch)
        request.settle.CopyFrom(settlement_to_pb(settle))
        response = await self._appends.append(request)
        result = response.results[0]
        return Appended(result.seq, result.duplicate), response.sticky_until_ms

    async def read(
        self, session_id: str, after_seq: int = 0, limit: int = 0, *, packed: bool = True
    ) -> tuple[list[CommittedFact], int]:
        """Up to `limit` facts after `after_seq` (0: the ledger's default page,
        at most MAX_PACKED_READ_LIMIT) and the stream's head.

        Asked for as a packed page (`packed`): decoded in one call, and
        bounded by this client's message limit too, so it may end before
        `limit` facts and before the head. A ledger without packed pages
        answers with `Fact` messages (at most 1000), read here just the same."""
        request = pb.ReadRequest(
            session_id=session_id,
            after_seq=after_seq,
            limit=limit,
            packed=packed,
            max_packed_bytes=self._max_packed_bytes if packed else 0,
        )
        response = await unary(self._stub.Read(request), LedgerError)
        if response.packed_facts:
            return facts_from_packed(session_id, response.packed_facts), response.head_seq
        return [fact_from_pb(f) for f in response.facts], response.head_seq

    async def read_all(self, session_id: str, after_seq: int = 0) -> list[CommittedFact]:
        """Every fact after `after_seq`, in the largest pages."""
        out: list[CommittedFact] = []
        while True:
            page, head = await self.read(session_id, after_seq, MAX_PACKED_READ_LIMIT)
            out.extend(page)
            if not page or page[-1].seq >= head:
                return out
            after_seq = page[-1].seq

    async def subscribe(self, session_id: str, after_seq: int = 0) -> AsyncIterator[CommittedFact]:
        call = self._stub.Subscribe(pb.SubscribeRequest(session_id=session_id, after_seq=after_seq))
        async for message in streaming(call, LedgerError):
            yield fact_from_pb(message.fact)

    async def get_session(self, session_id: str) -> SessionView:
        request = pb.GetSessionRequest(session_id=session_id)
        return view_from_pb(await unary(self._stub.GetSession(request), LedgerError))

    async def list_sessions(
        self, after_session_id: str = "", limit: int = 0, owing_only: bool = False
    ) -> SessionPage:
        """One page of sessions with ids > `after_session_id`, ascending."""
        request = pb.ListSessionsRequest(
            after_session_id=after_session_id, limit=limit, owing_only=owing_only
        )
        response = await unary(self._stub.ListSessions(request), LedgerError)
        return SessionPage(list(response.sessions), response.next_after_session_id)
