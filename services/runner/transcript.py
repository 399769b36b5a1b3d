"""What an attempt owes, read from the session's ledger facts.

Pure functions. "What is missing" is always a fact, never a guess: inputs up
to the attempt's watermark that no completed answer consumed, and tool calls
of the latest answer that have no result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compaction.transcript import (
    CANCELLED_STOP,
    context_entries,
    context_head,
    fold_facts,
    messages_of,
    parsed_context,
    presented_request,
    request_messages,
)
from services.ledger.facts import ASSISTANT, CANCELLED, INPUT, CommittedFact

__all__ = [
    "CANCELLED_STOP",
    "OpenCall",
    "Owed",
    "cancel_generation_id",
    "context_entries",
    "generation_id",
    "highest_input",
    "messages_of",
    "owed",
    "parsed_context",
    "presented_request",
    "request_messages",
]


def generation_id(context_head_seq: int) -> str:
    """The id of an answer built from the context ending at `context_head_seq`.

    Derived from the ledger only, so a successor re-answering the same context
    computes the same id and the ledger keeps one answer.
    """
    return f"gen-{context_head_seq}"


def cancel_generation_id(cancel_seq: int, input_seqs: Sequence[int]) -> str:
    """The id of the answer settling a cancel for `input_seqs`.

    One cancel may need two settlements: the cancelled attempt settles the
    inputs up to its watermark, and inputs committed before the cancel but
    above that watermark are settled by the next attempt. Naming the inputs
    keeps the two apart, while a successor repeating a settlement computes
    the same id and the ledger keeps one.
    """
    return f"cancel-{cancel_seq}-{max(input_seqs, default=0)}"


@dataclass(frozen=True)
class OpenCall:
    tool_call_id: str
    name: str
    arguments: Mapping[str, Any]
    assistant_seq: int


@dataclass(frozen=True)
class Owed:
    """What the ledger says is missing, for an attempt reading up to `watermark`."""

    watermark: int
    input_seqs: tuple[int, ...]
    open_calls: tuple[OpenCall, ...]
    # Inputs before the latest cancel that no answer consumed.
    cancelled_input_seqs: tuple[int, ...]
    latest_cancel_seq: int
    context_head_seq: int

    @property
    def nothing(self) -> bool:
        return not (self.input_seqs or self.open_calls or self.cancelled_input_seqs)


def highest_input(facts: Iterable[CommittedFact]) -> int:
    return max((f.seq for f in facts if f.kind == INPUT), default=0)


def owed(facts: Sequence[CommittedFact], watermark: int) -> Owed:
    """Unanswered inputs up to `watermark` and tool calls without results."""
    fold = fold_facts(facts)
    latest_cancel = max((f.seq for f in facts if f.kind == CANCELLED), default=0)
    inputs = [f.seq for f in facts if f.kind == INPUT and f.seq <= watermark]
    unanswered = [s for s in inputs if s not in fold.consumed]
    open_calls: list[OpenCall] = []
    latest_assistant = next((f for f in reversed(facts) if f.kind == ASSISTANT), None)
    if latest_assistant is not None:
        for call in latest_assistant.data.get("toolCalls") or ():
            if call["id"] not in fold.results:
                open_calls.append(
                    OpenCall(
                        call["id"], call["name"], call.get("arguments") or {}, latest_assistant.seq
                    )
                )
    return Owed(
        watermark=watermark,
        input_seqs=tuple(s for s in unanswered if s > latest_cancel),
        open_calls=tuple(open_calls),
        cancelled_input_seqs=tuple(s for s in unanswered if s < latest_cancel),
        latest_cancel_seq=latest_cancel,
        context_head_seq=context_head(facts, watermark),
    )
