"""The ledger's messages and their protobuf form, one codec per kind.

The servicer encodes with these and the client decodes with them, so a
field added to a fact or a session view is mapped in exactly one place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from keel.ledger.v1 import ledger_pb2 as pb
from services.ledger.fact_json import StoredData, decode_data
from services.ledger.facts import CommittedFact
from services.ledger.views import OpenToolCall, SessionView, Settlement


def _data_json(data: Mapping[str, Any]) -> str:
    if isinstance(data, StoredData):
        # Read from the store: the JSON text stored, which is what the
        # encoding below would produce, sent as it is. Typed as str, but the
        # message takes (and checks) UTF-8 bytes, which spares decoding them
        # here and the message encoding them back.
        return cast(str, data.utf8)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def fact_to_pb(fact: CommittedFact) -> pb.Fact:
    return pb.Fact(
        session_id=fact.session_id,
        seq=fact.seq,
        kind=fact.kind,
        data_json=_data_json(fact.data),
        timestamp_ms=fact.timestamp_ms,
        epoch=fact.epoch,
    )


def read_response(facts: Sequence[CommittedFact], head_seq: int) -> pb.ReadResponse:
    """`ReadResponse(facts=[fact_to_pb(f) ...], head_seq=...)`, with each fact
    written into the response directly: passing messages in copies each one,
    which cost as much again as making them."""
    response = pb.ReadResponse(head_seq=head_seq)
    add = response.facts.add
    for fact in facts:
        add(
            session_id=fact.session_id,
            seq=fact.seq,
            kind=fact.kind,
            data_json=_data_json(fact.data),
            timestamp_ms=fact.timestamp_ms,
            epoch=fact.epoch,
        )
    return response


def fact_from_pb(message: pb.Fact) -> CommittedFact:
    return CommittedFact(
        session_id=message.session_id,
        seq=message.seq,
        kind=message.kind,
        data=decode_data(message.data_json),
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
        parked_on=list(view.parked_on),
        parked_reason=view.parked_reason,
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
        parked_on=tuple(message.parked_on),
        parked_reason=message.parked_reason,
    )


def settlement_to_pb(settle: Settlement) -> pb.TurnSettlement:
    return pb.TurnSettlement(
        runtime_id=settle.runtime_id,
        read_through=settle.read_through,
        sticky_ms=settle.sticky_ms,
    )


def settlement_from_pb(request: pb.AppendRequest) -> Settlement | None:
    """The append's settlement, if it carries one (unchecked)."""
    if not request.HasField("settle"):
        return None
    settle = request.settle
    return Settlement(settle.runtime_id, settle.read_through, settle.sticky_ms)
