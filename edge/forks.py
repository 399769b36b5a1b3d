"""Fork and edit: a new session from another's history, for the HTTP and
gRPC APIs alike.

A fork at seq N is a new session of the caller's whose facts 1..N are the
parent's (copied by the ledger in one transaction, seqs kept), followed by
`forked_from {sessionId, seq}`. What a model request built at any s <= N
shows is the same in both, since it is a function of facts 1..s. The
parent is untouched, and the fork goes on on its own: an input it owes
(one of the parent's still unanswered at N) is answered in the fork.

"Edit and resend" is a fork at the seq before an input plus the edited text
as the fork's next input, in one call.

Copy, not reference: a fork holds its own rows, so every read, fold and
rebuild of a fork is that of an ordinary session; `keel bench fork` measures
what a copy costs.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edge import bodies, inputs
from edge.auth import Caller
from edge.bodies import EditBody, ForkBody
from edge.errors import BadRequest, Conflict, from_service_error
from edge.gateway import Gateway, SeqOutOfRange
from services.common.errors import KeelError
from services.ledger.errors import SessionExists
from services.ledger.facts import INPUT


@dataclass(frozen=True)
class Forked:
    """A fork: its public id, where it came from, and its head."""

    session_id: str
    parent_id: str
    at_seq: int
    head_seq: int
    # Set by an edit: the edited input, committed as the fork's.
    input: inputs.Committed | None = None

    def to_json(self) -> dict[str, Any]:
        forked: dict[str, Any] = {
            "id": self.session_id,
            "forkedFrom": {"id": self.parent_id, "seq": self.at_seq},
            "headSeq": self.head_seq,
        }
        if self.input is not None:
            forked["input"] = self.input.to_json()
        return forked


async def fork(
    gateway: Gateway, caller: Caller, session_id: str, body: ForkBody | Mapping[str, Any]
) -> Forked:
    """Forks the caller's session (`session_id`, a ledger id) at `body.at`."""
    body = bodies.convert(body, ForkBody)
    view = await gateway.session(caller, session_id)
    if body.at > view.head_seq:
        raise SeqOutOfRange(f"seq {body.at} is past the session's head {view.head_seq}", field="at")
    return await _fork_at(gateway, caller, session_id, body.at, body.id)


async def _fork_at(
    gateway: Gateway, caller: Caller, parent_id: str, at: int, new_id: str | None
) -> Forked:
    public_id = new_id or f"s-{uuid.uuid4().hex[:16]}"
    fork_id = gateway.ledger_session_id(caller, public_id)
    try:
        head = await gateway.ledger.fork_session(parent_id, fork_id, at)
    except SessionExists:
        raise Conflict("you have a session with this id already", reason="SESSION_EXISTS") from None
    except KeelError as error:
        raise from_service_error(error) from None
    view = await gateway.ledger.get_session(fork_id)
    if view.owes_work:
        # The parent's inputs unanswered at `at` are the fork's to answer.
        latest = max(view.owed_input_seqs, default=0)
        await gateway.kernel.enqueue(fork_id, caller.tenant_id, latest)
    return Forked(public_id, gateway.public_session_id(parent_id), at, head)


async def edit(
    gateway: Gateway,
    caller: Caller,
    session_id: str,
    body: EditBody | Mapping[str, Any],
    idempotency_key: str | None = None,
) -> Forked:
    """A fork at the seq before input `body.seq`, whose next input is
    `body.text`: the edited message, answered in the fork."""
    body = bodies.convert(body, EditBody)
    await gateway.session(caller, session_id)
    facts, _ = await gateway.ledger.read(session_id, body.seq - 1, 1)
    if not facts or facts[0].seq != body.seq or facts[0].kind != INPUT:
        raise BadRequest(f"seq {body.seq} is not an input of this session", field="seq")
    forked = await _fork_at(gateway, caller, session_id, body.seq - 1, None)
    fork_id = gateway.ledger_session_id(caller, forked.session_id)
    message: dict[str, Any] = {"text": body.text}
    if body.request_id is not None:
        message["requestId"] = body.request_id
    committed = await inputs.commit_input(gateway, caller, fork_id, message, idempotency_key)
    return Forked(forked.session_id, forked.parent_id, forked.at_seq, forked.head_seq, committed)
