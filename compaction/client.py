"""`CompactionClient`: the typed async client runners and the edge use.

Errors come back as the compaction service's own classes (`CompactionFenced`,
`SummaryFailed`, `NoSessionToCompact`, …; see `compaction.errors`), so callers
never inspect status codes. An unreachable service raises
`services.common.errors.ServiceUnavailable`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compaction.errors import CompactionError
from keel.compaction.v1 import compaction_pb2 as pb
from keel.compaction.v1 import compaction_pb2_grpc as pb_grpc
from services.common.config import Settings
from services.common.rpc import unary
from services.common.serving import open_channel


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """What a compaction would do now (nothing is committed by asking).

    `tokens_before` is the trigger's measure of the context (the latest usage
    figure plus estimates). `tokens_after` is a ceiling: the kept messages
    plus the most the summary may take; the real figure is known only once
    the summary is written.
    """

    should_compact: bool
    can_compact: bool
    first_kept_seq: int
    summarized_from_seq: int
    summarized_to_seq: int
    is_split_turn: bool
    tokens_before: int
    tokens_after: int
    context_window: int


@dataclass(frozen=True, slots=True)
class CompactResult:
    """The outcome of `compact`: committed (`compacted`, at `seq`) or skipped."""

    compacted: bool
    seq: int
    summary: str
    tokens_before: int
    tokens_after: int
    skipped_reason: str

    @property
    def not_reduced(self) -> bool:
        """A summary was written but not committed: it would not have made
        the context smaller (a wasted model call, unlike "nothing to compact")."""
        return not self.compacted and bool(self.summary)


@dataclass(frozen=True, slots=True)
class SessionContext:
    """What a request built at some point presents: the system prompt, then
    `messages` (transcript-shaped dicts, the latest summary first if any)."""

    system_prompt: str
    messages: tuple[Mapping[str, Any], ...]
    compaction_seq: int
    estimated_tokens: int
    # The loadout revision the system prompt comes from, and the read
    # watermark the request was built under (0: every input up to the point).
    loadout_revision: int = 0
    watermark: int = 0


class CompactionClient:
    """Async client of `keel.compaction.v1.CompactionService`."""

    def __init__(self, target: str, settings: Settings | None = None) -> None:
        self.target = target
        self._channel = open_channel(target, settings or Settings())
        self._stub = pb_grpc.CompactionServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(None)

    async def __aenter__(self) -> CompactionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def plan(self, session_id: str) -> CompactionPlan:
        request = pb.PlanRequest(session_id=session_id)
        response = await unary(self._stub.Plan(request), CompactionError)
        return CompactionPlan(
            should_compact=response.should_compact,
            can_compact=response.can_compact,
            first_kept_seq=response.first_kept_seq,
            summarized_from_seq=response.summarized_from_seq,
            summarized_to_seq=response.summarized_to_seq,
            is_split_turn=response.is_split_turn,
            tokens_before=response.tokens_before,
            tokens_after=response.tokens_after,
            context_window=response.context_window,
        )

    async def compact(
        self,
        session_id: str,
        epoch: int,
        reason: str = "manual",
        instructions: str = "",
        watermark: int = 0,
    ) -> CompactResult:
        """Summarizes and commits under `epoch` (raises CompactionFenced when a newer
        attempt owns the session). `reason`: threshold, overflow or manual.
        `watermark`: the caller's, when its epoch's epoch_started is an
        earlier turn's (a woken sticky session); 0 leaves it to that fact."""
        request = pb.CompactRequest(
            session_id=session_id,
            epoch=epoch,
            reason=reason,
            instructions=instructions,
            watermark=watermark,
        )
        response = await unary(self._stub.Compact(request), CompactionError)
        return CompactResult(
            compacted=response.compacted,
            seq=response.seq,
            summary=response.summary,
            tokens_before=response.tokens_before,
            tokens_after=response.tokens_after,
            skipped_reason=response.skipped_reason,
        )

    async def get_context(self, session_id: str, at_seq: int = 0) -> SessionContext:
        """What a request built at `at_seq` presented (0 = the head)."""
        request = pb.GetContextRequest(session_id=session_id, at_seq=at_seq)
        response = await unary(self._stub.GetContext(request), CompactionError)
        return SessionContext(
            system_prompt=response.system_prompt,
            messages=tuple(json.loads(response.messages_json or "[]")),
            compaction_seq=response.compaction_seq,
            estimated_tokens=response.estimated_tokens,
            loadout_revision=response.loadout_revision,
            watermark=response.watermark,
        )
