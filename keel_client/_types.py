"""What the client returns: frozen dataclasses decoded from the API's messages.

Each result has one `from_pb` decoder, so the async and the sync client
return the same values. JSON payloads (fact data, context messages, the
loadout) are parsed here, once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from keel.sessions.v1 import sessions_pb2 as pb


def _json_object(text: str, what: str) -> dict[str, Any]:
    value = json.loads(text) if text else {}
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    return value


@dataclass(frozen=True)
class PendingApproval:
    """A tool call waiting for a person's decision (`decide_approval`)."""

    tool_call_id: str
    name: str
    arguments: Mapping[str, Any]
    # The seq of its approval_requested fact.
    seq: int

    @classmethod
    def from_pb(cls, message: pb.PendingApproval) -> PendingApproval:
        return cls(
            tool_call_id=message.tool_call_id,
            name=message.name,
            arguments=_json_object(message.arguments_json, "a pending call's arguments"),
            seq=message.seq,
        )


@dataclass(frozen=True)
class Session:
    session_id: str
    head_seq: int
    # "idle", "running", "compacting", "parked" or "awaiting_approval".
    status: str
    owed_input_seqs: tuple[int, ...]
    latest_compaction_seq: int
    pending_approvals: tuple[PendingApproval, ...] = ()
    # When parked: the inputs it failed on (what skip_inputs settles; inputs
    # sent since are owed, not batched with them), and why.
    parked_on: tuple[int, ...] = ()
    parked_reason: str = ""

    @classmethod
    def from_pb(cls, message: pb.GetSessionResponse) -> Session:
        return cls(
            session_id=message.session_id,
            head_seq=message.head_seq,
            status=message.status,
            owed_input_seqs=tuple(message.owed_input_seqs),
            latest_compaction_seq=message.latest_compaction_seq,
            pending_approvals=tuple(PendingApproval.from_pb(p) for p in message.pending_approvals),
            parked_on=tuple(message.parked_on),
            parked_reason=message.parked_reason,
        )


@dataclass(frozen=True)
class SessionSummary:
    session_id: str
    head_seq: int


@dataclass(frozen=True)
class SessionPage:
    sessions: tuple[SessionSummary, ...]
    # Pass to list_sessions for the next page; "" on the last one.
    next_page_token: str

    @classmethod
    def from_pb(cls, message: pb.ListSessionsResponse) -> SessionPage:
        return cls(
            sessions=tuple(SessionSummary(s.session_id, s.head_seq) for s in message.sessions),
            next_page_token=message.next_page_token,
        )


@dataclass(frozen=True)
class Input:
    """A committed input (send_input, retry)."""

    seq: int
    # This request id had committed the input already: nothing new happened.
    duplicate: bool
    request_id: str
    # False when the edge made the request id: sending again would commit a
    # second input, so pass your own `request_id` to retry safely.
    retry_safe: bool

    @classmethod
    def from_pb(cls, message: pb.SendInputResponse | pb.RetryResponse) -> Input:
        return cls(
            seq=message.seq,
            duplicate=message.duplicate,
            request_id=message.request_id,
            retry_safe=message.retry_safe,
        )


@dataclass(frozen=True)
class Decision:
    """A committed decision on a waiting tool call (decide_approval)."""

    # The seq of the approval fact.
    seq: int
    # Who decided: the key the client acts with.
    by: str


@dataclass(frozen=True)
class Cancellation:
    # False when nothing was running or owed (no cancel was committed).
    cancelled: bool
    # The cancel fact's seq (0 when nothing was committed).
    seq: int
    # The inputs it settles: every input owed when it was committed.
    input_seqs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """A scheduled input: `cron` in `timezone`, or one time `at_ms`."""

    schedule_id: str
    text: str
    cron: str
    timezone: str
    at_ms: int
    next_fire_ms: int
    created_at_ms: int

    @classmethod
    def from_pb(cls, message: pb.Schedule) -> Schedule:
        return cls(
            schedule_id=message.schedule_id,
            text=message.text,
            cron=message.cron,
            timezone=message.timezone,
            at_ms=message.at_ms,
            next_fire_ms=message.next_fire_ms,
            created_at_ms=message.created_at_ms,
        )


@dataclass(frozen=True)
class Skip:
    """What skip_inputs settled: its fact's seq and the inputs it names."""

    seq: int
    skipped_input_seqs: tuple[int, ...]


@dataclass(frozen=True)
class Context:
    """Exactly what a model request built at `at_seq` presented."""

    at_seq: int
    system_prompt: str
    # The messages after the system prompt, in order, as the model saw them.
    messages: tuple[Mapping[str, Any], ...]
    compaction_seq: int
    loadout_revision: int
    watermark: int
    estimated_tokens: int

    @classmethod
    def from_pb(cls, message: pb.GetContextResponse) -> Context:
        messages = json.loads(message.messages_json) if message.messages_json else []
        if not isinstance(messages, list):
            raise ValueError("the context's messages are not a JSON array")
        return cls(
            at_seq=message.at_seq,
            system_prompt=message.system_prompt,
            messages=tuple(messages),
            compaction_seq=message.compaction_seq,
            loadout_revision=message.loadout_revision,
            watermark=message.watermark,
            estimated_tokens=message.estimated_tokens,
        )


@dataclass(frozen=True)
class Loadout:
    revision: int
    document: Mapping[str, Any]

    @classmethod
    def from_pb(cls, message: pb.GetLoadoutResponse) -> Loadout:
        return cls(message.revision, _json_object(message.document_json, "the loadout"))


# ------------------------------------------------------------------ events


@dataclass(frozen=True)
class Fact:
    """A committed fact: seqs are 1, 2, 3, ... per session, never repeated."""

    seq: int
    kind: str
    timestamp_ms: int
    epoch: int
    data: Mapping[str, Any]

    @classmethod
    def from_pb(cls, message: pb.Fact) -> Fact:
        return cls(
            seq=message.seq,
            kind=message.kind,
            timestamp_ms=message.timestamp_ms,
            epoch=message.epoch,
            data=_json_object(message.data_json, f"fact {message.seq}'s data"),
        )


@dataclass(frozen=True)
class Delta:
    """Token-level output of an attempt; never a fact.

    (generation_id, epoch, attempt_id) names one attempt's stream: when any
    of them changes, a preview starts over. After a reconnect the current
    attempt's deltas come again from its first token.
    """

    generation_id: str
    epoch: int
    attempt_id: str
    # "text", "thinking" or "tool_call".
    channel: str
    text: str
    tool_call_id: str = ""
    tool_name: str = ""

    @classmethod
    def from_pb(cls, message: pb.Delta) -> Delta:
        return cls(
            generation_id=message.generation_id,
            epoch=message.epoch,
            attempt_id=message.attempt_id,
            channel=message.channel,
            text=message.text,
            tool_call_id=message.tool_call_id,
            tool_name=message.tool_name,
        )


@dataclass(frozen=True)
class Status:
    # "idle", "running" or "compacting".
    state: str
    epoch: int

    @classmethod
    def from_pb(cls, message: pb.Status) -> Status:
        return cls(state=message.state, epoch=message.epoch)


Event: TypeAlias = Fact | Delta | Status
