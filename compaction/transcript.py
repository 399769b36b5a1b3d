"""From a session's ledger facts to what a model request presents.

Pure functions: the same facts always give the same context, so a successor
rebuilds exactly what a dead attempt would have sent, the compaction service
summarizes exactly what requests presented, and the edge can show what any
request presented (`context at seq N`).

Ordering rule: a message stands where it entered the model's view, which is
not always its ledger position. Runner facts (answers, tool results,
compactions) enter at their seq. An input enters when the first request
that included it was answered: an attempt's requests include every unread
input up to its watermark, so an input is placed just before the first
answer or compaction written under a watermark that covers it. Inputs that
arrive while an attempt runs therefore come after the answer to the inputs
it read, never before it, and never between a tool call and its result;
inputs no answer has covered yet come last, as the next request presents
them.

A cancelled exchange is out of the context whole: the inputs the cancel
settled, every answer and tool result since the last completed answer, and
the settling answer itself.

Inputs a parked session failed on and a person skipped stay in the context,
each skip followed by a short note in the assistant's voice saying they
were skipped and why (`skip_note`): the model sees what was asked, and that
it was not answered, without being asked it again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from compaction.policy import ContextEntry, build_context, to_entries
from services.ledger.facts import (
    ASSISTANT,
    COMPACTION,
    EPOCH_STARTED,
    INPUT,
    INPUTS_SKIPPED,
    TOOL_RESULT,
    CommittedFact,
)

CANCELLED_STOP = "cancelled"

# A blob id -> the content parts the model sees for it (images as image
# parts, text files as text). Resolved by the caller, which has the store.
# An input shows every part of its blobs; a tool result only the images.
BlobParts: TypeAlias = Callable[[str], list[dict[str, Any]]]


@dataclass
class Fold:
    consumed: set[int] = field(default_factory=set)
    results: dict[str, int] = field(default_factory=dict)


def fold_facts(facts: Iterable[CommittedFact]) -> Fold:
    fold = Fold()
    for fact in facts:
        if fact.kind == ASSISTANT:
            fold.consumed.update(fact.data.get("inputSeqs") or ())
        elif fact.kind == INPUTS_SKIPPED:
            fold.consumed.update(fact.data["inputSeqs"])
        elif fact.kind == TOOL_RESULT:
            fold.results[fact.data["toolCallId"]] = fact.seq
    return fold


def context_head(facts: Sequence[CommittedFact], watermark: int) -> int:
    """Seq of the latest fact a request at this point is built from."""
    head = 0
    for fact in facts:
        if fact.kind == INPUT and fact.seq > watermark:
            continue
        if fact.kind in (INPUT, ASSISTANT, TOOL_RESULT, COMPACTION, INPUTS_SKIPPED):
            head = fact.seq
    return head


def skip_note(data: Mapping[str, Any]) -> str:
    """What the model is told of inputs it was not made to answer again."""
    count = len(data.get("inputSeqs") or ())
    which = "this message was" if count == 1 else f"these {count} messages were"
    on = "it" if count == 1 else "them"
    return f"({which} skipped after the model failed on {on}: {data.get('reason', '')})"


def _call_arguments(call: Mapping[str, Any]) -> Any:
    """A call's arguments as the model is shown them: the exact text it sent
    when that was not a JSON object (`argumentsText`), else the object.
    Showing `{}` instead would tell the model it made a different call."""
    text = call.get("argumentsText")
    if isinstance(text, str):
        return text
    return call.get("arguments") or {}


def _assistant_message(data: Mapping[str, Any]) -> dict[str, Any]:
    content: list[Any] = list(data.get("content") or [])
    for call in data.get("toolCalls") or ():
        content.append(
            {
                "type": "toolCall",
                "id": call["id"],
                "name": call["name"],
                "arguments": _call_arguments(call),
            }
        )
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if data.get("usage"):
        message["usage"] = data["usage"]
    if data.get("stopReason"):
        message["stopReason"] = data["stopReason"]
    return message


def _user_message(data: Mapping[str, Any], blob_parts: BlobParts | None) -> dict[str, Any]:
    text = data.get("text", "")
    blobs = data.get("blobs") or ()
    if not blobs or blob_parts is None:
        return {"role": "user", "content": text}
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for blob_id in blobs:
        content.extend(blob_parts(blob_id))
    return {"role": "user", "content": content}


def _tool_result_message(
    data: Mapping[str, Any], tool_name: str, blob_parts: BlobParts | None
) -> dict[str, Any]:
    text = data.get("content", "")
    content: str | list[dict[str, Any]] = text
    images = _tool_images(data, blob_parts)
    if images:
        content = [{"type": "text", "text": text}] if text else []
        content.extend(images)
    return {
        "role": "toolResult",
        "toolCallId": data["toolCallId"],
        "toolName": tool_name,
        "content": content,
        "isError": bool(data.get("isError", False)),
    }


def _tool_images(data: Mapping[str, Any], blob_parts: BlobParts | None) -> list[dict[str, Any]]:
    """The image parts of the blobs a tool returned, in the order it returned them.

    Images only: the result's text already names every blob (its type and
    size), and a stored text or binary resource stays out of the context as
    it was, so the tool's result limit still bounds the text a tool adds.
    """
    if blob_parts is None:
        return []
    return [
        part
        for blob_id in data.get("blobs") or ()
        for part in blob_parts(blob_id)
        if part.get("type") == "image"
    ]


def referenced_blobs(facts: Iterable[CommittedFact], watermark: int | None) -> list[str]:
    """Blob ids a request built from `facts` may present: those of the inputs
    up to `watermark` and those the tools returned, for the caller to read
    ahead (resolving one that was not read blocks on the store)."""
    return [
        blob_id
        for fact in facts
        if fact.kind == TOOL_RESULT
        or (fact.kind == INPUT and (watermark is None or fact.seq <= watermark))
        for blob_id in fact.data.get("blobs") or ()
    ]


def cancelled_exchanges(facts: Iterable[CommittedFact]) -> set[int]:
    """Seqs of every fact of a cancelled exchange: the inputs the cancel
    settled, the answers and tool results since the last completed answer,
    and the settling answer. Keeping only part of an exchange would show the
    model a tool call without the question that led to it."""
    dropped: set[int] = set()
    exchange: list[int] = []
    for fact in facts:
        if fact.kind == TOOL_RESULT:
            exchange.append(fact.seq)
        elif fact.kind == ASSISTANT:
            if fact.data.get("stopReason") == CANCELLED_STOP:
                dropped.update(exchange)
                dropped.add(fact.seq)
                dropped.update(fact.data.get("inputSeqs") or ())
                exchange.clear()
            elif fact.data.get("toolCalls"):
                exchange.append(fact.seq)
            else:
                exchange.clear()
    return dropped


@dataclass(frozen=True, slots=True)
class Placed:
    """A context entry where it stands, before its message is built: the
    fact, and what its place decided (a compaction's first kept position, a
    tool result's tool name). Building messages costs more than placing
    them, and a caller may need only some of them."""

    fact: CommittedFact
    first_kept_index: int = 0
    tool_name: str = ""


def placed_context(facts: Sequence[CommittedFact], watermark: int | None = None) -> list[Placed]:
    """The entries of `context_entries`, in its order, unbuilt (see `entry_of`)."""
    fold = fold_facts(facts)
    dropped = cancelled_exchanges(facts)
    names: dict[str, str] = {}
    entries: list[Placed] = []
    position_of_seq: dict[int, int] = {}
    # Inputs read by no request yet, in seq order.
    unplaced: deque[Placed] = deque()
    # Calls whose result is committed later: nothing may come between.
    waiting: set[str] = set()
    epoch_watermark = 0
    # A skip's note follows the last input it skipped, once that is placed.
    notes = {max(fact.data["inputSeqs"]): fact for fact in facts if fact.kind == INPUTS_SKIPPED}

    def place(entry: Placed) -> None:
        position_of_seq[entry.fact.seq] = len(entries)
        entries.append(entry)

    def place_inputs_up_to(limit: int | None) -> None:
        while unplaced and (limit is None or unplaced[0].fact.seq <= limit):
            placed = unplaced.popleft()
            place(placed)
            note = notes.get(placed.fact.seq)
            if note is not None:
                place(Placed(note))

    for fact in facts:
        if fact.seq in dropped:
            continue
        if fact.kind == INPUT:
            if watermark is None or fact.seq <= watermark:
                unplaced.append(Placed(fact))
        elif fact.kind == EPOCH_STARTED:
            epoch_watermark = int(fact.data.get("watermark", 0))
        elif fact.kind == ASSISTANT:
            # A later turn of a sticky session says its own watermark.
            epoch_watermark = _declared_watermark(fact, epoch_watermark)
            if not waiting:
                place_inputs_up_to(epoch_watermark)
            for call in fact.data.get("toolCalls") or ():
                names[call["id"]] = call["name"]
                if call["id"] in fold.results:
                    waiting.add(call["id"])
            place(Placed(fact))
        elif fact.kind == TOOL_RESULT:
            call_id = fact.data["toolCallId"]
            place(Placed(fact, tool_name=names.get(call_id, "")))
            waiting.discard(call_id)
        elif fact.kind == COMPACTION:
            epoch_watermark = _declared_watermark(fact, epoch_watermark)
            if not waiting:
                place_inputs_up_to(epoch_watermark)
            first_kept = position_of_seq.get(int(fact.data["firstKept"]), len(entries))
            place(Placed(fact, first_kept_index=first_kept))
    # What the next request presents after the history: every input it reads.
    place_inputs_up_to(None)
    return entries


def _declared_watermark(fact: CommittedFact, current: int) -> int:
    declared = fact.data.get("watermark")
    return current if declared is None else int(declared)


def entry_of(placed: Placed, blob_parts: BlobParts | None = None) -> dict[str, Any]:
    """A placed entry in the compaction-policy shape, with its `seq`."""
    fact = placed.fact
    if fact.kind == COMPACTION:
        return {
            "type": "compaction",
            "summary": fact.data["summary"],
            "firstKeptIndex": placed.first_kept_index,
            "seq": fact.seq,
        }
    if fact.kind == INPUT:
        message = _user_message(fact.data, blob_parts)
    elif fact.kind == ASSISTANT:
        message = _assistant_message(fact.data)
    elif fact.kind == INPUTS_SKIPPED:
        message = {"role": "assistant", "content": [{"type": "text", "text": skip_note(fact.data)}]}
    else:
        message = _tool_result_message(fact.data, placed.tool_name, blob_parts)
    return {"type": "message", "message": message, "seq": fact.seq}


def context_entries(
    facts: Sequence[CommittedFact],
    watermark: int | None = None,
    blob_parts: BlobParts | None = None,
) -> list[dict[str, Any]]:
    """The session's context entries (compaction-policy shape), each with its `seq`,
    in the order the model saw them (see the module docstring).

    `watermark` hides inputs an attempt has not read; `blob_parts` turns the
    blobs an input references into content parts, and the images a tool
    returned into image parts of its result (without it, only the text).
    """
    return [entry_of(placed, blob_parts) for placed in placed_context(facts, watermark)]


def parsed_context(
    facts: Sequence[CommittedFact],
    watermark: int | None = None,
    blob_parts: BlobParts | None = None,
) -> tuple[ContextEntry, ...]:
    """`context_entries` parsed into the policy's values: the whole session's
    list (the runner parses only the window a request presents, see
    `services.runner.transcript.windowed_context`)."""
    return to_entries(context_entries(facts, watermark, blob_parts))


def messages_of(entries: Sequence[ContextEntry]) -> tuple[dict[str, Any], ...]:
    """The messages a request built from these context entries presents."""
    return presented_request(entries)[0]


def presented_request(entries: Sequence[ContextEntry]) -> tuple[tuple[dict[str, Any], ...], int]:
    """`messages_of(entries)`, and the policy's token estimate of those messages."""
    presented = build_context(entries)
    return tuple(m.to_dict() for m in presented), sum(m.tokens for m in presented)


def request_messages(
    facts: Sequence[CommittedFact],
    watermark: int | None = None,
    blob_parts: BlobParts | None = None,
) -> tuple[dict[str, Any], ...]:
    """Exactly the messages a model request built from `facts` presents.

    One function for the runner's requests and for "what did the model see at
    seq N", so the two can never disagree.
    """
    return messages_of(parsed_context(facts, watermark, blob_parts=blob_parts))
