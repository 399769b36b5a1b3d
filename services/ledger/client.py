"""`LedgerClient`: the typed async client other services use.

Errors come back as the ledger's own exception classes (`StaleEpoch`,
`IdempotencyConflict`, …), so callers never inspect status codes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from keel.ledger.v1 import ledger_pb2 as pb
from keel.ledger.v1 import ledger_pb2_grpc as pb_grpc
from services.common.config import Settings
from services.common.errors import error_from_rpc, reasons_of
from services.common.serving import open_channel
from services.ledger.domain import Appended, OpenToolCall, SessionView
from services.ledger.errors import LedgerError
from services.ledger.facts import CommittedFact

_REASONS = reasons_of(LedgerError)


@dataclass(frozen=True)
class FactToAppend:
    kind: str
    data: Mapping[str, Any]


@dataclass(frozen=True)
class SessionPage:
    sessions: list[pb.SessionSummary]
    # Where the next page starts; "" when the listing is complete.
    next_after: str


def _to_fact(message: pb.Fact) -> CommittedFact:
    return CommittedFact(
        session_id=message.session_id,
        seq=message.seq,
        kind=message.kind,
        data=json.loads(message.data_json or "{}"),
        timestamp_ms=message.timestamp_ms,
        epoch=message.epoch,
    )


def _to_view(message: pb.GetSessionResponse) -> SessionView:
    return SessionView(
        session_id=message.session_id,
        tenant_id=message.tenant_id,
        head_seq=message.head_seq,
        fence_epoch=message.fence_epoch,
        owed_input_seqs=tuple(message.owed_input_seqs),
        open_tool_calls=tuple(
            OpenToolCall(c.tool_call_id, c.name, c.assistant_seq) for c in message.open_tool_calls
        ),
        latest_compaction_seq=message.latest_compaction_seq,
        read_watermark=message.read_watermark,
        parked=message.parked,
        latest_cancel_seq=message.latest_cancel_seq,
        context_head_seq=message.context_head_seq,
    )


class LedgerClient:
    """Async client of `keel.ledger.v1.LedgerService`."""

    def __init__(self, target: str, settings: Settings | None = None) -> None:
        self._channel = open_channel(target, settings or Settings())
        self._stub = pb_grpc.LedgerServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(None)

    async def __aenter__(self) -> LedgerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create_session(self, session_id: str, tenant_id: str) -> bool:
        try:
            response = await self._stub.CreateSession(
                pb.CreateSessionRequest(session_id=session_id, tenant_id=tenant_id)
            )
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, LedgerError, _REASONS) from None
        return response.created

    async def append(
        self, session_id: str, facts: Sequence[FactToAppend], epoch: int = 0
    ) -> list[Appended]:
        request = pb.AppendRequest(
            session_id=session_id,
            epoch=epoch,
            facts=[
                pb.NewFact(kind=f.kind, data_json=json.dumps(f.data, ensure_ascii=False))
                for f in facts
            ],
        )
        try:
            response = await self._stub.Append(request)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, LedgerError, _REASONS) from None
        return [Appended(r.seq, r.duplicate) for r in response.results]

    async def append_one(
        self, session_id: str, kind: str, data: Mapping[str, Any], epoch: int = 0
    ) -> Appended:
        return (await self.append(session_id, [FactToAppend(kind, data)], epoch))[0]

    async def read(
        self, session_id: str, after_seq: int = 0, limit: int = 0
    ) -> tuple[list[CommittedFact], int]:
        try:
            response = await self._stub.Read(
                pb.ReadRequest(session_id=session_id, after_seq=after_seq, limit=limit)
            )
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, LedgerError, _REASONS) from None
        return [_to_fact(f) for f in response.facts], response.head_seq

    async def read_all(self, session_id: str, after_seq: int = 0) -> list[CommittedFact]:
        """Every fact after `after_seq`, page by page."""
        out: list[CommittedFact] = []
        while True:
            page, head = await self.read(session_id, after_seq, 1000)
            out.extend(page)
            if not page or page[-1].seq >= head:
                return out
            after_seq = page[-1].seq

    async def subscribe(self, session_id: str, after_seq: int = 0) -> AsyncIterator[CommittedFact]:
        call = self._stub.Subscribe(pb.SubscribeRequest(session_id=session_id, after_seq=after_seq))
        try:
            async for message in call:
                yield _to_fact(message.fact)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, LedgerError, _REASONS) from None
        finally:
            call.cancel()

    async def get_session(self, session_id: str) -> SessionView:
        try:
            response = await self._stub.GetSession(pb.GetSessionRequest(session_id=session_id))
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, LedgerError, _REASONS) from None
        return _to_view(response)

    async def list_sessions(
        self, after_session_id: str = "", limit: int = 0, owing_only: bool = False
    ) -> SessionPage:
        """One page of sessions with ids > `after_session_id`, ascending."""
        try:
            response = await self._stub.ListSessions(
                pb.ListSessionsRequest(
                    after_session_id=after_session_id, limit=limit, owing_only=owing_only
                )
            )
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err, LedgerError, _REASONS) from None
        return SessionPage(list(response.sessions), response.next_after_session_id)
