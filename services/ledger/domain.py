"""The session stream: one eventsourcing aggregate per session.

The aggregate's version is the fact's `seq`, so a stream is gap-free by
construction and optimistic concurrency on the version makes every decision
below (dedup, fence) atomic with the write that follows it: a decision made
on a stale copy fails to insert and is taken again on fresh state.

No I/O here. The store loads and saves; this module decides.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from eventsourcing.domain import (
    BaseAggregate,
    CanInitAggregate,
    CanMutateAggregate,
    MetaDomainEvent,
)

from services.ledger import facts as F
from services.ledger.errors import (
    ApprovalDecided,
    ApprovalNotPending,
    IdempotencyConflict,
    InvalidFact,
    SessionBusy,
    StaleEpoch,
    UnknownToolCall,
)
from services.ledger.views import Appended, OpenToolCall, SessionView


def timestamp_ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


class SessionEvent(CanMutateAggregate[str], metaclass=MetaDomainEvent):
    """Base of a session stream's events: string ids, not the default UUIDs."""

    originator_id: str
    originator_version: int
    timestamp: datetime


class SessionStream(BaseAggregate[str]):
    """Every fact of one session, folded into the indexes decisions need."""

    class Event(SessionEvent):
        pass

    class Created(Event, CanInitAggregate[str]):
        originator_topic: str
        session_id: str
        tenant_id: str

    class Recorded(Event):
        kind: str
        data: dict[str, Any]
        epoch: int

        def apply(self, aggregate: Any) -> None:
            assert isinstance(aggregate, SessionStream)
            aggregate.fold(self.originator_version, self.kind, self.data)

    @staticmethod
    def create_id(session_id: str, tenant_id: str) -> str:
        # Session ids are chosen by the caller (string ids), not UUIDs.
        return session_id

    def __init__(self, session_id: str, tenant_id: str) -> None:
        self.tenant_id = tenant_id
        self.fence_epoch = 0
        self.read_watermark = 0
        self.latest_compaction_seq = 0
        self.latest_cancel_seq = 0
        self.context_head_seq = 0
        self.last_input_seq = 0
        # The latest fact after which a parked session is parked no more: a
        # person's way out (a retry, a skip, a decision on a waiting tool
        # call), or an attempt that ran (a history written when any new
        # input unparked a session). A plain input leaves it parked: it is
        # owed, and never batched with the inputs the session failed on.
        self.last_unpark_seq = 0
        self.parked_at = 0
        # The latest park's failed inputs and reason.
        self.parked_on: tuple[int, ...] = ()
        self.parked_reason = ""
        # Dedup indexes: request id -> (seq, body fingerprint), etc.
        self.requests: dict[str, tuple[int, str]] = {}
        # A rollback's input request id -> the seq of the cancel made for it.
        self.rollbacks: dict[str, int] = {}
        self.generations: dict[str, int] = {}
        self.tool_calls: dict[str, OpenToolCall] = {}
        self.tool_results: dict[str, int] = {}
        # Tool call id -> seq of its approval_requested, and of its decision.
        self.approval_requests: dict[str, int] = {}
        self.decisions: dict[str, int] = {}
        self.approved: dict[str, bool] = {}
        # Insertion-ordered sets (dicts) so owed inputs stay ascending.
        self.owed_inputs: dict[int, None] = {}
        self.open_calls: dict[str, None] = {}

    # -- folding committed facts (used on write and on rebuild alike) --

    def fold(self, seq: int, kind: str, data: dict[str, Any]) -> None:
        if kind in F.CONTEXT_KINDS:
            self.context_head_seq = seq
        if kind == F.INPUT:
            self.requests[data["requestId"]] = (seq, F.input_fingerprint(data))
            self.owed_inputs[seq] = None
            self.last_input_seq = seq
            if data.get("retryOf") is not None:
                self.last_unpark_seq = seq
        elif kind == F.EPOCH_STARTED:
            self.fence_epoch = int(data["epoch"])
            self.read_watermark = int(data["watermark"])
            self.last_unpark_seq = seq
        elif kind == F.ASSISTANT:
            self.generations[data["generationId"]] = seq
            for call in data.get("toolCalls") or ():
                self.tool_calls[call["id"]] = OpenToolCall(call["id"], call["name"], seq)
                self.open_calls[call["id"]] = None
            for input_seq in data.get("inputSeqs") or ():
                self.owed_inputs.pop(input_seq, None)
        elif kind == F.TOOL_RESULT:
            self.tool_results[data["toolCallId"]] = seq
            self.open_calls.pop(data["toolCallId"], None)
        elif kind == F.APPROVAL_REQUESTED:
            self.approval_requests[data["toolCallId"]] = seq
        elif kind == F.APPROVAL:
            self.decisions[data["toolCallId"]] = seq
            self.approved[data["toolCallId"]] = bool(data["approve"])
            self.last_unpark_seq = seq
        elif kind == F.COMPACTION:
            self.latest_compaction_seq = seq
        elif kind == F.CANCELLED:
            self.latest_cancel_seq = seq
            if data.get("requestId") is not None:
                self.rollbacks[data["requestId"]] = seq
        elif kind == F.SESSION_PARKED:
            self.parked_at = seq
            self.parked_on = tuple(data.get("inputSeqs") or ())
            self.parked_reason = str(data["reason"])
        elif kind == F.FORKED_FROM:
            # The copied facts are another session's history: this one's
            # own runners start again at epoch 1.
            self.fence_epoch = 0
        elif kind == F.INPUTS_SKIPPED:
            for input_seq in data["inputSeqs"]:
                self.owed_inputs.pop(input_seq, None)
            self.last_unpark_seq = seq

    # -- deciding --

    def copy_of(self, facts: Sequence[F.CommittedFact]) -> None:
        """Records `facts` (another session's, after its creation fact) as
        they are, as a fork's history. Nothing is checked:
        they were decided when the parent committed them."""
        for fact in facts:
            self.trigger_event(
                self.Recorded, kind=fact.kind, data=dict(fact.data), epoch=fact.epoch
            )

    def record(
        self, new_facts: Sequence[F.NewFact], epoch: int, only_if_idle: bool = False
    ) -> list[Appended]:
        """Appends `new_facts` in order, or raises without deciding the rest.

        Raises before any event is triggered when the writer is fenced off, so
        a stale writer never leaves a partial trace on the aggregate; and, with
        `only_if_idle`, when the session owes work (SessionBusy).
        """
        self._check_fence(new_facts, epoch)
        if only_if_idle and (self.owed_inputs or self.open_calls):
            owed = ", ".join(str(s) for s in self.owed_inputs) or "none"
            raise SessionBusy(
                f"the session is busy (owed inputs: {owed}; open tool calls: "
                f"{len(self.open_calls)}): nothing was committed",
            )
        return [self._record_one(fact, epoch) for fact in new_facts]

    def _check_fence(self, new_facts: Iterable[F.NewFact], epoch: int) -> None:
        fence = self.fence_epoch
        for fact in new_facts:
            if epoch == 0:
                if fact.kind not in F.CLIENT_KINDS:
                    raise InvalidFact(f"{fact.kind} facts are written by a runner with an epoch")
                continue
            if fact.kind == F.EPOCH_STARTED:
                claimed = int(fact.data["epoch"])
                if claimed != epoch:
                    raise InvalidFact("epoch_started.epoch must equal the request epoch")
                if claimed <= fence:
                    raise StaleEpoch(
                        f"epoch {claimed} is not newer than the fence {fence}",
                        epoch=str(epoch),
                        fence=str(fence),
                    )
                fence = claimed
            elif epoch != fence:
                raise StaleEpoch(
                    f"writer epoch {epoch} is not the current fence {fence}",
                    epoch=str(epoch),
                    fence=str(fence),
                )

    def _record_one(self, fact: F.NewFact, epoch: int) -> Appended:
        data = fact.data
        if fact.kind == F.INPUT:
            known = self.requests.get(data["requestId"])
            if known is not None:
                if known[1] != F.input_fingerprint(data):
                    raise IdempotencyConflict(
                        f"request id {data['requestId']!r} was used for another input",
                        seq=str(known[0]),
                    )
                return Appended(known[0], True)
            retry_of = data.get("retryOf")
            if retry_of is not None and retry_of not in self._input_seqs():
                raise InvalidFact(f"retryOf {retry_of} is not an input of this session")
        elif fact.kind == F.ASSISTANT:
            existing = self.generations.get(data["generationId"])
            if existing is not None:
                return Appended(existing, True)
            inputs = self._input_seqs()
            for seq in data.get("inputSeqs") or ():
                if seq not in inputs:
                    raise InvalidFact(f"inputSeqs names {seq}, which is not an input")
            for call in data.get("toolCalls") or ():
                if call["id"] in self.tool_calls:
                    raise InvalidFact(f"tool call id {call['id']!r} was already used")
        elif fact.kind == F.COMPACTION:
            if data["firstKept"] > self.version:
                raise InvalidFact(
                    f"compaction.firstKept {data['firstKept']} is beyond the head "
                    f"{self.version}: it must name a committed fact",
                    field="firstKept",
                )
        elif fact.kind == F.TOOL_RESULT:
            call_id = data["toolCallId"]
            existing = self.tool_results.get(call_id)
            if existing is not None:
                return Appended(existing, True)
            if call_id not in self.tool_calls:
                raise UnknownToolCall(f"no tool call {call_id!r} in this session")
        elif fact.kind == F.APPROVAL_REQUESTED:
            self._check_approval_request(data["toolCallId"])
            existing = self.approval_requests.get(data["toolCallId"])
            if existing is not None:
                # A retried attempt asks again: the first request stands.
                return Appended(existing, True)
        elif fact.kind == F.APPROVAL:
            self._check_decision(data["toolCallId"])
        elif fact.kind == F.CANCELLED and data.get("requestId") is not None:
            # A retried rollback: its cancel was made (or its input came
            # another way) already; withdrawing again would withdraw more.
            request_id = data["requestId"]
            if request_id in self.rollbacks:
                return Appended(self.rollbacks[request_id], True)
            if request_id in self.requests:
                return Appended(self.requests[request_id][0], True)
        elif fact.kind == F.INPUTS_SKIPPED:
            for seq in data["inputSeqs"]:
                if seq not in self.owed_inputs:
                    raise InvalidFact(
                        f"inputs_skipped names {seq}, which is not an owed input",
                        field="inputSeqs",
                    )
        self.trigger_event(self.Recorded, kind=fact.kind, data=dict(data), epoch=epoch)
        return Appended(self.version, False)

    def _check_approval_request(self, call_id: str) -> None:
        if call_id not in self.tool_calls:
            raise UnknownToolCall(f"no tool call {call_id!r} in this session")
        if call_id in self.tool_results and call_id not in self.approval_requests:
            raise InvalidFact(f"tool call {call_id!r} has a result: nothing to approve")

    def _check_decision(self, call_id: str) -> None:
        """One decision per call, and only for a call that waits for one.

        Decided here, on the aggregate, so that two decisions racing for one
        call cannot both land: the loser's insert fails on the stream version
        and its retry, on fresh state, finds the winner's decision."""
        decided = self.decisions.get(call_id)
        if decided is not None:
            raise ApprovalDecided(
                f"tool call {call_id!r} was decided already (seq {decided})",
                seq=str(decided),
                approve=str(self.approved[call_id]).lower(),
            )
        if call_id not in self.approval_requests:
            raise ApprovalNotPending(f"tool call {call_id!r} does not wait for a decision")
        if call_id in self.tool_results:
            raise ApprovalNotPending(
                f"tool call {call_id!r} has a result already (seq {self.tool_results[call_id]})"
            )

    def _input_seqs(self) -> set[int]:
        return {seq for seq, _ in self.requests.values()}

    @property
    def parked(self) -> bool:
        return self.parked_at > self.last_unpark_seq

    def view(self) -> SessionView:
        return SessionView(
            session_id=str(self.id),
            tenant_id=self.tenant_id,
            head_seq=self.version,
            fence_epoch=self.fence_epoch,
            owed_input_seqs=tuple(self.owed_inputs),
            open_tool_calls=tuple(self.tool_calls[c] for c in self.open_calls),
            latest_compaction_seq=self.latest_compaction_seq,
            read_watermark=self.read_watermark,
            parked=self.parked,
            parked_on=self.parked_on if self.parked else (),
            parked_reason=self.parked_reason if self.parked else "",
            latest_cancel_seq=self.latest_cancel_seq,
            context_head_seq=self.context_head_seq,
            waiting_tool_call_ids=tuple(
                c
                for c in self.open_calls
                if c in self.approval_requests and c not in self.decisions
            ),
        )


def forked_from_event(session_id: str, seq: int, origin: dict[str, Any]) -> SessionStream.Recorded:
    """A fork's `forked_from` at `seq`, made apart from its aggregate: the
    facts before it are copied by the store, not triggered one by one."""
    fields: dict[str, Any] = {
        "originator_id": session_id,
        "originator_version": seq,
        "timestamp": SessionStream.Recorded.create_timestamp(),
        "kind": F.FORKED_FROM,
        "data": origin,
        "epoch": 0,
    }
    return SessionStream.Recorded(**fields)


def to_committed(session_id: str, event: Any) -> F.CommittedFact:
    """A stored domain event as the fact clients see."""
    if isinstance(event, SessionStream.Created):
        return F.CommittedFact(
            session_id=session_id,
            seq=event.originator_version,
            kind=F.SESSION_CREATED,
            data={"tenantId": event.tenant_id},
            timestamp_ms=timestamp_ms(event.timestamp),
            epoch=0,
        )
    return F.CommittedFact(
        session_id=session_id,
        seq=event.originator_version,
        kind=event.kind,
        data=event.data,
        timestamp_ms=timestamp_ms(event.timestamp),
        epoch=event.epoch,
    )
