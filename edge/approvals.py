"""Approvals: a person decides a tool call that waits for one (SPEC §12).

A runner commits `approval_requested {toolCallId, name, arguments}` for a call
of a tool its loadout lists under `requireApproval`, and the session rests:
no lease, no admission slot. The decision is committed here as an `approval`
fact (a client fact, written without an epoch, like an input), then the
kernel is woken exactly as for an input, with the decision's seq; the next
attempt runs an approved call, or commits a denial as an error result.

Exactly one decision per call: the ledger decides that on the session's
aggregate, so two decisions racing for one call cannot both land. A decision
for a call that does not wait for one (unknown, never asked about, or closed
by a cancel) is a 409 `approval_not_pending`; a second decision is a 409
`approval_already_decided` whose message names the first one's seq. Over gRPC
the same refusals are FAILED_PRECONDITION `APPROVAL_NOT_PENDING` and
ALREADY_EXISTS `APPROVAL_ALREADY_DECIDED`.

Who decided (`by`) is the caller's key id, as `keel keys list` shows it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from edge import bodies
from edge.auth import Caller
from edge.bodies import DecisionBody
from edge.errors import BadRequest, Conflict, from_service_error, shown
from services.common.errors import KeelError
from services.ledger import LedgerClient, SessionView
from services.ledger.errors import ApprovalDecided, ApprovalNotPending
from services.ledger.facts import (
    APPROVAL,
    APPROVAL_REQUESTED,
    TOOL_RESULT,
    check_id,
)

if TYPE_CHECKING:
    from edge.gateway import Gateway

log = logging.getLogger(__name__)

# Facts read per page while looking for the approvals a session waits on.
_PAGE = 500


class NotPending(Conflict):
    """No such call waits for a decision."""

    code = "approval_not_pending"
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "APPROVAL_NOT_PENDING"


class AlreadyDecided(Conflict):
    """The call was decided before; the first decision stands."""

    code = "approval_already_decided"
    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    reason = "APPROVAL_ALREADY_DECIDED"


@dataclass(frozen=True)
class PendingApproval:
    """A tool call of the session waiting for a person's decision."""

    tool_call_id: str
    name: str
    arguments: Mapping[str, Any]
    # The seq of its approval_requested fact.
    seq: int

    def to_json(self) -> dict[str, Any]:
        return {
            "toolCallId": self.tool_call_id,
            "name": self.name,
            "arguments": dict(self.arguments),
            "seq": self.seq,
        }


@dataclass(frozen=True)
class Decided:
    """A committed decision, as the client is told of it."""

    seq: int
    tool_call_id: str
    approve: bool
    by: str

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "toolCallId": self.tool_call_id,
            "approve": self.approve,
            "by": self.by,
        }


def decider(caller: Caller) -> str:
    """The `by` of a caller's decisions: its key's id (as `keel keys list`
    shows it), or a prefix of the key's hash for a key without one."""
    if caller.key_id:
        return caller.key_id
    return f"key:{caller.key_hash[:12]}" if caller.key_hash else "key"


async def pending_approvals(ledger: LedgerClient, view: SessionView) -> tuple[PendingApproval, ...]:
    """The session's calls waiting for a decision, in the order asked.

    Read from the facts after the earliest open call's answer (a call's
    approval facts always follow it), and only when a call is open."""
    open_ids = {call.tool_call_id for call in view.open_tool_calls}
    if not open_ids:
        return ()
    after = min(call.assistant_seq for call in view.open_tool_calls)
    requested: dict[str, PendingApproval] = {}
    while after < view.head_seq:
        facts, _ = await ledger.read(view.session_id, after, _PAGE)
        if not facts:
            break
        for fact in facts:
            call_id = fact.data.get("toolCallId")
            if fact.kind == APPROVAL_REQUESTED and call_id in open_ids:
                requested[call_id] = PendingApproval(
                    call_id,
                    str(fact.data.get("name", "")),
                    fact.data.get("arguments") or {},
                    fact.seq,
                )
            elif fact.kind in (APPROVAL, TOOL_RESULT):
                requested.pop(str(call_id), None)
        after = facts[-1].seq
    return tuple(requested.values())


def _decision(body: DecisionBody) -> tuple[str, bool, str | None]:
    """(toolCallId, approve, note) of a decoded body, or a 400 naming the field."""
    try:
        check_id(body.tool_call_id, "toolCallId")
    except KeelError:
        raise BadRequest(
            f"toolCallId {shown(body.tool_call_id)} is not a tool call id", field="toolCallId"
        ) from None
    return body.tool_call_id, body.approve, body.note or None


async def decide(
    gateway: Gateway, caller: Caller, session_id: str, body: DecisionBody | Mapping[str, Any]
) -> Decided:
    """Commits the caller's decision on a waiting call, then wakes the kernel.

    `session_id` is the ledger's id (another tenant's session is a 404)."""
    call_id, approve, note = _decision(bodies.convert(body, DecisionBody))
    await gateway.check_owner(caller, session_id)
    by = decider(caller)
    data: dict[str, Any] = {"toolCallId": call_id, "approve": approve, "by": by}
    if note is not None:
        data["note"] = note
    try:
        appended = await gateway.ledger.append_one(session_id, APPROVAL, data)
    except (ApprovalNotPending, ApprovalDecided) as error:
        raise _refusal(call_id, error) from None
    except KeelError as error:
        raise from_service_error(error) from None
    try:
        # Woken exactly as an input wakes it: the kernel queues the session
        # unless an attempt has read through this seq.
        await gateway.kernel.enqueue(session_id, caller.tenant_id, appended.seq, unpark=True)
    except KeelError as error:
        # Committed: the ledger now says the session owes work, and the
        # kernel's reconciliation with the ledger queues it (a retry of this
        # request would only be told the call is decided).
        log.warning(
            "approval %s of %s committed, wake-up failed: %s", appended.seq, session_id, error
        )
    return Decided(appended.seq, call_id, approve, by)


def _refusal(call_id: str, error: ApprovalNotPending | ApprovalDecided) -> Conflict:
    """The ledger's refusal as the edge's 409 (the ledger's message may
    quote the id at length); its metadata (the first decision's seq and
    outcome) goes on to gRPC callers."""
    refusal: Conflict
    if isinstance(error, ApprovalDecided):
        first = error.metadata.get("seq", "?")
        refusal = AlreadyDecided(
            f"tool call {shown(call_id)} was decided already (seq {first}); "
            "the first decision stands"
        )
    else:
        refusal = NotPending(f"tool call {shown(call_id)} does not wait for a decision")
    refusal.metadata.update(error.metadata)
    return refusal
