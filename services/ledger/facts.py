"""The facts a session stream may hold, and how each must look.

Pure functions only: the servicer validates every fact here before it is
queued for commit, so a malformed fact is refused with a clear reason and
never reaches the store.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Literal, TypeAlias

import msgspec

from services.ledger.errors import FactTooLarge, InvalidCursor, InvalidFact

# check_id and the note limit are part of this module's API (callers
# import them from here); they live with the schema that uses them.
from services.ledger.fact_schema import MAX_APPROVAL_NOTE_CHARS as MAX_APPROVAL_NOTE_CHARS
from services.ledger.fact_schema import SCHEMAS, refusal
from services.ledger.fact_schema import check_id as check_id

SESSION_CREATED: Final = "session_created"
INPUT: Final = "input"
EPOCH_STARTED: Final = "epoch_started"
ASSISTANT: Final = "assistant"
TOOL_RESULT: Final = "tool_result"
COMPACTION: Final = "compaction"
ATTEMPT_FAILED: Final = "attempt_failed"
CANCELLED: Final = "cancelled"
SESSION_PARKED: Final = "session_parked"
COMPACTION_FAILED: Final = "compaction_failed"
# A tool call that waits for a person's decision, and that decision.
APPROVAL_REQUESTED: Final = "approval_requested"
APPROVAL: Final = "approval"
# What an input asks of work already under way when it arrives (the
# edge's `multitask`): `enqueue` it (answered next), `reject` it while work
# is owed, `interrupt` the running attempt (the next one answers the earlier
# inputs and this one together), or `rollback` (the earlier inputs are
# withdrawn by a cancel committed with this input: only it is answered).
Multitask: TypeAlias = Literal["enqueue", "reject", "interrupt", "rollback"]
MULTITASK_MODES: Final[tuple[Multitask, ...]] = ("enqueue", "reject", "interrupt", "rollback")
INTERRUPT: Final = "interrupt"
# The inputs a parked session failed on, settled without an answer at a
# person's request (POST …/skip): the model sees a short note instead.
INPUTS_SKIPPED: Final = "inputs_skipped"
# The first fact of a fork's own, after the parent's facts it copied: which
# session and seq it was forked from. Written by the ledger (ForkSession).
FORKED_FROM: Final = "forked_from"
# Every kind above: the type of a kind a writer names.
FactKind: TypeAlias = Literal[
    "session_created",
    "input",
    "epoch_started",
    "assistant",
    "tool_result",
    "compaction",
    "attempt_failed",
    "cancelled",
    "session_parked",
    "compaction_failed",
    "approval_requested",
    "approval",
    "inputs_skipped",
    "forked_from",
]

# Clients (through the edge) write these without an epoch, at any time.
CLIENT_KINDS: Final = frozenset({INPUT, CANCELLED, APPROVAL, INPUTS_SKIPPED})
# Only the owner of the current epoch writes these.
RUNNER_KINDS: Final = frozenset(
    {
        EPOCH_STARTED,
        ASSISTANT,
        TOOL_RESULT,
        COMPACTION,
        ATTEMPT_FAILED,
        SESSION_PARKED,
        COMPACTION_FAILED,
        APPROVAL_REQUESTED,
    }
)
APPENDABLE_KINDS: Final = CLIENT_KINDS | RUNNER_KINDS
# Facts a model request is built from. The generation id derives from the
# latest of these, so bookkeeping (watermarks, failures) never changes it.
CONTEXT_KINDS: Final = frozenset({INPUT, ASSISTANT, TOOL_RESULT, COMPACTION, INPUTS_SKIPPED})

MAX_READ_LIMIT: Final = 1000
DEFAULT_READ_LIMIT: Final = 500
MAX_FACTS_PER_APPEND: Final = 256


# The two fact records are frozen msgspec structs, not dataclasses: one is
# made per fact on every append and every read (a cold rebuild reads them by
# the thousand), and a frozen dataclass takes over ten times as long to make.
class NewFact(msgspec.Struct, frozen=True):
    """A validated fact, not yet committed."""

    kind: str
    data: Mapping[str, Any]


class CommittedFact(msgspec.Struct, frozen=True, gc=False):
    session_id: str
    seq: int
    kind: str
    data: Mapping[str, Any]
    timestamp_ms: int
    epoch: int


def check_cursor(after_seq: int) -> int:
    if after_seq < 0:
        raise InvalidCursor(f"cursor must be >= 0, got {after_seq}")
    return after_seq


def check_limit(limit: int) -> int:
    if limit < 0:
        raise InvalidCursor(f"limit must be >= 0, got {limit}")
    return min(limit or DEFAULT_READ_LIMIT, MAX_READ_LIMIT)


def fact_bytes(data_json: str, max_bytes: int) -> int:
    """The stored size of a fact's JSON: its UTF-8 bytes, not its characters
    (one character may take four). Encoded only when the count could matter."""
    if len(data_json) * 4 <= max_bytes:
        return len(data_json)
    return len(data_json.encode("utf-8", "surrogatepass"))


def parse_fact(kind: str, data_json: str, max_bytes: int) -> NewFact:
    """Validates one fact from the wire; raises InvalidFact with a reason."""
    if kind not in APPENDABLE_KINDS:
        allowed = ", ".join(sorted(APPENDABLE_KINDS))
        raise InvalidFact(f"unknown fact kind {kind[:64]!r}; one of: {allowed}", field="kind")
    size = fact_bytes(data_json, max_bytes)
    if size > max_bytes:
        raise FactTooLarge(
            f"{kind} fact is {size} bytes; the limit is {max_bytes}",
            limit=str(max_bytes),
            size=str(size),
        )
    data = _decode(kind, data_json or "{}")
    try:
        msgspec.convert(data, SCHEMAS[kind])
    except msgspec.ValidationError as error:
        raise refusal(kind, error) from None
    return NewFact(kind=kind, data=data)


# Read as plain JSON values, so fields a kind does not name are kept as sent.
_JSON = msgspec.json.Decoder()


def _decode(kind: str, data_json: str) -> dict[str, Any]:
    try:
        data = _JSON.decode(data_json)
    except (msgspec.MsgspecError, UnicodeError):
        # What msgspec refuses and Python's json reads (NaN, a number past
        # a float's range, a lone surrogate) was accepted before msgspec
        # decoded facts, and stays accepted: the stricter reader must not
        # start refusing a runner's facts. JSON neither reads is refused
        # with json's message, as before.
        data = _lenient(kind, data_json)
    except RecursionError:
        raise InvalidFact(f"{kind} data is nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidFact(f"{kind} data must be a JSON object")
    return data


def _lenient(kind: str, data_json: str) -> Any:
    try:
        return json.loads(data_json)
    except json.JSONDecodeError as exc:
        raise InvalidFact(f"{kind} data is not JSON: {exc.msg}") from None
    except RecursionError:
        raise InvalidFact(f"{kind} data is nested too deeply") from None


_FINGERPRINT = msgspec.json.Encoder()


def input_fingerprint(data: Mapping[str, Any]) -> str:
    """What makes two inputs with one request id "the same body".

    Compared only with fingerprints made here, in this process (the
    aggregate keeps them in memory, never stored): any encoding that is a
    function of the three values will do, and msgspec's is the cheapest.
    Taken for every input a stream is rebuilt from."""
    body = [data.get("text"), data.get("retryOf"), data.get("blobs") or []]
    try:
        return _FINGERPRINT.encode(body).decode()
    except UnicodeEncodeError:  # a lone surrogate, which only json.dumps writes
        return json.dumps(body, ensure_ascii=False)
