"""What the ledger answers about a session, as plain values: an append's
outcome and a consistent view of a stream's derived state.

Apart from the aggregate (`services.ledger.domain`) that computes them, so a
client of the ledger reads them without loading eventsourcing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Appended:
    """The outcome of one fact of an append: its seq, and whether it existed."""

    seq: int
    duplicate: bool


@dataclass(frozen=True)
class Settlement:
    """A successful attempt's Finish, carried by its last append so the
    append's transaction settles the lease too (services/common/
    turn_settlement.py); the epoch is the append's."""

    runtime_id: str
    read_through: int
    sticky_ms: int


@dataclass(frozen=True)
class OpenToolCall:
    tool_call_id: str
    name: str
    assistant_seq: int


@dataclass(frozen=True)
class SessionView:
    """A consistent read of a stream's derived state."""

    session_id: str
    tenant_id: str
    head_seq: int
    fence_epoch: int
    owed_input_seqs: tuple[int, ...]
    open_tool_calls: tuple[OpenToolCall, ...]
    latest_compaction_seq: int
    read_watermark: int
    parked: bool
    latest_cancel_seq: int
    context_head_seq: int
    # Open tool calls waiting for a person's decision (approval_requested,
    # no approval yet). Not carried by the ledger's GetSession message: a
    # view read through the client has none, and `owes_work` there counts
    # them as owed (the ListSessions summary's `owes_work` is exact).
    waiting_tool_call_ids: tuple[str, ...] = ()
    # While parked: the inputs the session failed on (those a skip settles;
    # none named by a park older than this field) and why.
    parked_on: tuple[int, ...] = ()
    parked_reason: str = ""

    @property
    def owes_work(self) -> bool:
        """Whether an attempt has something to do now.

        A call waiting for a decision is not work, and neither is an input
        behind it: the model cannot be asked again while its call has no
        result, so such an input stays owed until the call is decided. A
        cancel is work either way (it closes the waiting call)."""
        if self.parked:
            return False
        waiting = set(self.waiting_tool_call_ids)
        if any(call.tool_call_id not in waiting for call in self.open_tool_calls):
            return True
        if not waiting:
            return bool(self.owed_input_seqs)
        return any(seq < self.latest_cancel_seq for seq in self.owed_input_seqs)
