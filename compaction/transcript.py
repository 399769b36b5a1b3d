"""From a session's ledger facts to what a model request presents.

Pure functions: the same facts always give the same context, so a successor
rebuilds exactly what a dead attempt would have sent, the compaction service
summarizes exactly what requests presented, and the edge can show what any
request presented (`context at seq N`).

Ordering rule: an input that was committed while a tool call was still
waiting for its result is presented after that result. Providers require a
tool result to follow its call directly, and the input really did arrive
later in the conversation's causal order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from compaction.policy import ContextEntry, MessageEntry, build_context, entry_from_dict, to_entries
from services.ledger.facts import (
    ASSISTANT,
    COMPACTION,
    INPUT,
    TOOL_RESULT,
    CommittedFact,
)

CANCELLED_STOP = "cancelled"


@dataclass
class Fold:
    consumed: set[int] = field(default_factory=set)
    cancelled_answers: set[int] = field(default_factory=set)
    results: dict[str, int] = field(default_factory=dict)


def fold_facts(facts: Iterable[CommittedFact]) -> Fold:
    fold = Fold()
    for fact in facts:
        if fact.kind == ASSISTANT:
            fold.consumed.update(fact.data.get("inputSeqs") or ())
            if fact.data.get("stopReason") == CANCELLED_STOP:
                fold.cancelled_answers.add(fact.seq)
        elif fact.kind == TOOL_RESULT:
            fold.results[fact.data["toolCallId"]] = fact.seq
    return fold


def context_head(facts: Sequence[CommittedFact], watermark: int) -> int:
    """Seq of the latest fact a request at this point is built from."""
    head = 0
    for fact in facts:
        if fact.kind == INPUT and fact.seq > watermark:
            continue
        if fact.kind in (INPUT, ASSISTANT, TOOL_RESULT, COMPACTION):
            head = fact.seq
    return head


def _assistant_message(data: Mapping[str, Any]) -> dict[str, Any]:
    content: list[Any] = list(data.get("content") or [])
    for call in data.get("toolCalls") or ():
        content.append(
            {
                "type": "toolCall",
                "id": call["id"],
                "name": call["name"],
                "arguments": call.get("arguments") or {},
            }
        )
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if data.get("usage"):
        message["usage"] = data["usage"]
    if data.get("stopReason"):
        message["stopReason"] = data["stopReason"]
    return message


def _user_message(data: Mapping[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": data.get("text", "")}


def _tool_result_message(data: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    call_id = data["toolCallId"]
    return {
        "role": "toolResult",
        "toolCallId": call_id,
        "toolName": names.get(call_id, ""),
        "content": data.get("content", ""),
        "isError": bool(data.get("isError", False)),
    }


def context_entries(
    facts: Sequence[CommittedFact], watermark: int | None = None
) -> list[dict[str, Any]]:
    """The session's context entries (compaction-policy shape), each with its `seq`.

    `watermark` hides inputs an attempt has not read. Cancelled exchanges
    (inputs settled by a cancel, and the settling answer) are not context.
    """
    fold = fold_facts(facts)
    cancelled_inputs: set[int] = set()
    for fact in facts:
        if fact.kind == ASSISTANT and fact.seq in fold.cancelled_answers:
            cancelled_inputs.update(fact.data.get("inputSeqs") or ())
    names: dict[str, str] = {}
    entries: list[dict[str, Any]] = []
    deferred: list[dict[str, Any]] = []
    waiting: set[str] = set()
    position_of_seq: dict[int, int] = {}
    for fact in facts:
        if fact.kind == INPUT:
            if (watermark is not None and fact.seq > watermark) or fact.seq in cancelled_inputs:
                continue
            entry = {"type": "message", "message": _user_message(fact.data), "seq": fact.seq}
            if waiting:
                deferred.append(entry)
                continue
        elif fact.kind == ASSISTANT:
            if fact.seq in fold.cancelled_answers:
                continue
            for call in fact.data.get("toolCalls") or ():
                names[call["id"]] = call["name"]
                if call["id"] in fold.results:
                    waiting.add(call["id"])
            entry = {"type": "message", "message": _assistant_message(fact.data), "seq": fact.seq}
        elif fact.kind == TOOL_RESULT:
            entry = {
                "type": "message",
                "message": _tool_result_message(fact.data, names),
                "seq": fact.seq,
            }
            waiting.discard(fact.data["toolCallId"])
        elif fact.kind == COMPACTION:
            first_kept = int(fact.data["firstKept"])
            entry = {
                "type": "compaction",
                "summary": fact.data["summary"],
                "firstKeptIndex": position_of_seq.get(first_kept, len(entries)),
                "seq": fact.seq,
            }
        else:
            continue
        position_of_seq[fact.seq] = len(entries)
        entries.append(entry)
        if not waiting and deferred:
            for late in deferred:
                position_of_seq[late["seq"]] = len(entries)
                entries.append(late)
            deferred.clear()
    for late in deferred:
        position_of_seq[late["seq"]] = len(entries)
        entries.append(late)
    return entries


def parsed_context(
    facts: Sequence[CommittedFact],
    watermark: int | None = None,
    memo: dict[int, MessageEntry] | None = None,
) -> tuple[ContextEntry, ...]:
    """`context_entries` parsed into the policy's values.

    `memo` (seq -> parsed message) spares re-parsing the same history at every
    turn. It is sound because a message entry depends only on its own fact and
    the facts before it, which never change; compaction entries depend on
    their position and are always parsed afresh.
    """
    raw_entries = context_entries(facts, watermark)
    if memo is None:
        return to_entries(raw_entries)
    parsed: list[ContextEntry] = []
    for position, raw in enumerate(raw_entries):
        seq = raw["seq"]
        entry: ContextEntry | None = memo.get(seq) if raw["type"] == "message" else None
        if entry is None:
            entry = entry_from_dict(raw, position)
            if isinstance(entry, MessageEntry):
                memo[seq] = entry
        parsed.append(entry)
    return tuple(parsed)


def messages_of(entries: Sequence[ContextEntry]) -> tuple[dict[str, Any], ...]:
    """The messages a request built from these context entries presents."""
    return presented_request(entries)[0]


def presented_request(entries: Sequence[ContextEntry]) -> tuple[tuple[dict[str, Any], ...], int]:
    """`messages_of(entries)`, and the policy's token estimate of those messages."""
    presented = build_context(entries)
    return tuple(m.to_dict() for m in presented), sum(m.tokens for m in presented)


def request_messages(
    facts: Sequence[CommittedFact], watermark: int | None = None
) -> tuple[dict[str, Any], ...]:
    """Exactly the messages a model request built from `facts` presents.

    One function for the runner's requests and for "what did the model see at
    seq N", so the two can never disagree.
    """
    return messages_of(parsed_context(facts, watermark))
