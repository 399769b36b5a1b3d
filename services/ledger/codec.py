"""The ledger's messages and their protobuf form, one codec per kind.

The servicer encodes with these and the client decodes with them, so a
field added to a fact or a session view is mapped in exactly one place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from keel.ledger.v1 import ledger_pb2 as pb
from services.ledger.domain import OpenToolCall, SessionView
from services.ledger.facts import CommittedFact


def fact_to_pb(fact: CommittedFact) -> pb.Fact:
    return pb.Fact(
        session_id=fact.session_id,
        seq=fact.seq,
        kind=fact.kind,
        data_json=json.dumps(fact.data, ensure_ascii=False, separators=(",", ":")),
        timestamp_ms=fact.timestamp_ms,
        epoch=fact.epoch,
    )


def fact_from_pb(message: pb.Fact) -> CommittedFact:
    return CommittedFact(
        session_id=message.session_id,
        seq=message.seq,
        kind=message.kind,
        data=json.loads(message.data_json or "{}"),
        timestamp_ms=message.timestamp_ms,
        epoch=message.epoch,
    )


def new_fact_to_pb(kind: str, data: Mapping[str, Any]) -> pb.NewFact:
    """A fact to append (the servicer parses it with `facts.parse_fact`)."""
    return pb.NewFact(kind=kind, data_json=json.dumps(data, ensure_ascii=False))


def view_to_pb(view: SessionView) -> pb.GetSessionResponse:
    return pb.GetSessionResponse(
        session_id=view.session_id,
        tenant_id=view.tenant_id,
        head_seq=view.head_seq,
        fence_epoch=view.fence_epoch,
        owed_input_seqs=list(view.owed_input_seqs),
        open_tool_calls=[
            pb.ToolCallRef(tool_call_id=c.tool_call_id, name=c.name, assistant_seq=c.assistant_seq)
            for c in view.open_tool_calls
        ],
        latest_compaction_seq=view.latest_compaction_seq,
        read_watermark=view.read_watermark,
        parked=view.parked,
        latest_cancel_seq=view.latest_cancel_seq,
        context_head_seq=view.context_head_seq,
    )


def view_from_pb(message: pb.GetSessionResponse) -> SessionView:
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
