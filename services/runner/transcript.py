"""What an attempt owes, read from the session's ledger facts.

Pure functions. "What is missing" is always a fact, never a guess: inputs up
to the attempt's watermark that no completed answer consumed, and tool calls
of the latest answer that have no result.

A call that waits for a person (`approval_requested`, no `approval` yet) is
not owed: nothing can be done for it until the decision is committed, and
neither can the model be asked again while one of its calls has no result,
so the inputs behind it stay owed without being workable. A decision makes
the call owed again, carrying the decision; a cancel closes it either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compaction.policy import ContextEntry, MessageEntry, entry_from_dict
from compaction.transcript import (
    CANCELLED_STOP,
    BlobParts,
    Placed,
    context_entries,
    entry_of,
    messages_of,
    placed_context,
    presented_request,
    referenced_blobs,
    request_messages,
)
from services.ledger.facts import (
    APPROVAL,
    APPROVAL_REQUESTED,
    ASSISTANT,
    CANCELLED,
    COMPACTION,
    INPUT,
    INPUTS_SKIPPED,
    TOOL_RESULT,
    CommittedFact,
)

__all__ = [
    "CANCELLED_STOP",
    "CUT_OFF_STOP",
    "Decision",
    "OpenCall",
    "Owed",
    "cancel_generation_id",
    "context_entries",
    "generation_id",
    "highest_input",
    "messages_of",
    "owed",
    "presented_request",
    "read_through",
    "referenced_blobs",
    "refusal",
    "request_messages",
    "windowed_context",
]

# The stop reason of a response cut by the output limit: its tool calls may
# be incomplete, so none of them is run.
CUT_OFF_STOP = "length"
# How much of a malformed arguments text an error result quotes.
QUOTED_ARGUMENTS_CHARS = 200


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
class Decision:
    """A person's decision on a call that waited for approval."""

    approve: bool
    by: str
    note: str = ""
    seq: int = 0


@dataclass(frozen=True)
class OpenCall:
    tool_call_id: str
    name: str
    arguments: Mapping[str, Any]
    assistant_seq: int
    # The model's arguments as sent, when they were not a JSON object.
    arguments_text: str | None = None
    # The response that made the call was cut by the output limit.
    cut_off: bool = False
    # An approval_requested was committed for this call.
    approval_requested: bool = False
    decision: Decision | None = None


@dataclass(frozen=True)
class Owed:
    """What the ledger says is missing, for an attempt reading up to `watermark`."""

    watermark: int
    input_seqs: tuple[int, ...]
    # Calls to act on now (run, refuse, or ask a person about).
    open_calls: tuple[OpenCall, ...]
    # Inputs before the latest cancel that no answer consumed.
    cancelled_input_seqs: tuple[int, ...]
    latest_cancel_seq: int
    context_head_seq: int
    # Calls waiting for a person's decision: not owed until it arrives.
    waiting_calls: tuple[OpenCall, ...] = ()

    @property
    def blocked(self) -> bool:
        """Inputs are owed, but the model cannot be asked while a call waits."""
        return bool(self.input_seqs and self.waiting_calls)

    @property
    def nothing(self) -> bool:
        """Nothing an attempt can do now (waiting calls and the inputs behind
        them wait for a person, not for an attempt)."""
        answerable = self.input_seqs and not self.waiting_calls
        return not (answerable or self.open_calls or self.cancelled_input_seqs)


def highest_input(facts: Iterable[CommittedFact]) -> int:
    return max((f.seq for f in facts if f.kind == INPUT), default=0)


def read_through(facts: Iterable[CommittedFact]) -> int:
    """The seq an attempt reads through: its latest input or decision.

    A decision wakes a session as an input does (the kernel is told its
    seq), so an attempt that has read it must say so when it finishes, or
    the kernel would queue the session again for a decision already acted
    on. Only inputs are compared with it, so as a watermark it presents the
    same inputs as the highest input seq would."""
    return max((f.seq for f in facts if f.kind in (INPUT, APPROVAL)), default=0)


def _approvals(
    facts: Sequence[CommittedFact], after_seq: int
) -> tuple[set[str], dict[str, Decision]]:
    """Calls with an approval request, and the decisions, after `after_seq`
    (a call's approval facts always follow the answer that made it)."""
    requested: set[str] = set()
    decisions: dict[str, Decision] = {}
    for fact in reversed(facts):
        if fact.seq <= after_seq:
            break
        if fact.kind == APPROVAL_REQUESTED:
            requested.add(fact.data["toolCallId"])
        elif fact.kind == APPROVAL:
            decisions[fact.data["toolCallId"]] = Decision(
                approve=bool(fact.data["approve"]),
                by=str(fact.data.get("by", "")),
                note=str(fact.data.get("note") or ""),
                seq=fact.seq,
            )
    return requested, decisions


def owed(facts: Sequence[CommittedFact], watermark: int) -> Owed:
    """Unanswered inputs up to `watermark` and tool calls without results."""
    # One pass over a session that may hold thousands of facts: the answers'
    # consumed inputs and the results (as `compaction.transcript.fold_facts`
    # folds them), the latest cancel and answer, and the context head (as
    # `compaction.transcript.context_head` finds it).
    consumed: set[int] = set()
    results: set[str] = set()
    inputs: list[int] = []
    latest_cancel = head = 0
    latest_assistant: CommittedFact | None = None
    for fact in facts:
        kind = fact.kind
        if kind == INPUT:
            if fact.seq <= watermark:
                inputs.append(fact.seq)
                head = fact.seq
        elif kind == ASSISTANT:
            consumed.update(fact.data.get("inputSeqs") or ())
            latest_assistant = fact
            head = fact.seq
        elif kind == INPUTS_SKIPPED:
            consumed.update(fact.data["inputSeqs"])
            head = fact.seq
        elif kind == TOOL_RESULT:
            results.add(fact.data["toolCallId"])
            head = fact.seq
        elif kind == COMPACTION:
            head = fact.seq
        elif kind == CANCELLED:
            latest_cancel = fact.seq
    unanswered = [s for s in inputs if s not in consumed]
    open_calls: list[OpenCall] = []
    waiting: list[OpenCall] = []
    if latest_assistant is not None:
        requested, decisions = _approvals(facts, latest_assistant.seq)
        cut_off = latest_assistant.data.get("stopReason") == CUT_OFF_STOP
        for call in latest_assistant.data.get("toolCalls") or ():
            if call["id"] in results:
                continue
            text = call.get("argumentsText")
            open_call = OpenCall(
                call["id"],
                call["name"],
                call.get("arguments") or {},
                latest_assistant.seq,
                arguments_text=text if isinstance(text, str) else None,
                cut_off=cut_off,
                approval_requested=call["id"] in requested,
                decision=decisions.get(call["id"]),
            )
            if open_call.approval_requested and open_call.decision is None:
                waiting.append(open_call)
            else:
                open_calls.append(open_call)
    return Owed(
        watermark=watermark,
        input_seqs=tuple(s for s in unanswered if s > latest_cancel),
        open_calls=tuple(open_calls),
        cancelled_input_seqs=tuple(s for s in unanswered if s < latest_cancel),
        latest_cancel_seq=latest_cancel,
        context_head_seq=head,
        waiting_calls=tuple(waiting),
    )


def windowed_context(
    facts: Sequence[CommittedFact],
    watermark: int | None = None,
    memo: dict[int, MessageEntry] | None = None,
    blob_parts: BlobParts | None = None,
) -> tuple[ContextEntry, ...]:
    """The context entries a request is built from, parsed into the policy's
    values: those of `compaction.transcript.parsed_context` from the latest
    compaction's first kept entry on (positions counted from there).

    Nothing before that entry is presented, sized or compacted again (the
    policy starts every walk at the latest compaction's first kept entry), so
    a successor rebuilding a long session builds and parses only what the
    next request can show, not the whole history. The request, the size
    estimate and the compaction decision are those of the full list.

    `memo` (seq -> parsed message) spares building and parsing the same
    messages at every turn. It is sound because a message entry depends only
    on its own fact and the facts before it, which never change; compaction
    entries depend on their position and are always parsed afresh. (Blobs
    never change once complete, so a message's resolved parts do not either.)
    """
    placed = placed_context(facts, watermark)
    start = presented_from(placed)
    parsed: list[ContextEntry] = []
    for position, entry in enumerate(placed[start:]):
        seq = entry.fact.seq
        if entry.fact.kind == COMPACTION:
            shifted = Placed(entry.fact, first_kept_index=entry.first_kept_index - start)
            parsed.append(entry_from_dict(entry_of(shifted), position))
            continue
        message = memo.get(seq) if memo is not None else None
        if message is None:
            built = entry_from_dict(entry_of(entry, blob_parts), position)
            assert isinstance(built, MessageEntry)
            message = built
            if memo is not None:
                memo[seq] = message
        parsed.append(message)
    return tuple(parsed)


def presented_from(placed: Sequence[Placed]) -> int:
    """The position of the latest compaction's first kept entry (0 without
    one), moved back as far as any compaction after it reaches, so that every
    compaction left in the list points inside it."""
    for position in range(len(placed) - 1, -1, -1):
        if placed[position].fact.kind == COMPACTION:
            start = placed[position].first_kept_index
            break
    else:
        return 0
    while True:
        reached = min(
            (e.first_kept_index for e in placed[start:] if e.fact.kind == COMPACTION),
            default=start,
        )
        if reached >= start:
            return start
        start = reached


def refusal(call: OpenCall) -> str | None:
    """Why `call` must not run (the error result the model sees), or None.

    Never a call the model did not make: arguments that were not a JSON
    object are not replaced by `{}`, and the calls of a response cut at the
    output limit may be incomplete. A denial is the person's, with the note."""
    if call.arguments_text is not None:
        return (
            f"not run: the arguments of {call.name} are not a JSON object: "
            f"{_quoted(call.arguments_text)}"
        )
    if call.cut_off:
        return (
            f"not run: the response was cut off at the output limit, so this call of "
            f"{call.name} may be incomplete; make it again with complete arguments"
        )
    decision = call.decision
    if decision is not None and not decision.approve:
        said = f": {decision.note}" if decision.note else ""
        return f"denied by {decision.by}{said}"
    return None


def _quoted(text: str) -> str:
    """`text` quoted for an error result, shortened (the assistant fact keeps
    all of it, and the model is shown all of it there)."""
    if len(text) <= QUOTED_ARGUMENTS_CHARS:
        return repr(text)
    return f"{text[:QUOTED_ARGUMENTS_CHARS]!r}… ({len(text)} characters)"
