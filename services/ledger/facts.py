"""The facts a session stream may hold, and how each must look.

Pure functions only: the servicer validates every fact here before it is
queued for commit, so a malformed fact is refused with a clear reason and
never reaches the store.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from services.ledger.errors import FactTooLarge, InvalidCursor, InvalidFact, InvalidId

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

# Clients (through the edge) write these without an epoch, at any time.
CLIENT_KINDS: Final = frozenset({INPUT, CANCELLED, APPROVAL})
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
CONTEXT_KINDS: Final = frozenset({INPUT, ASSISTANT, TOOL_RESULT, COMPACTION})

# Matched whole (`fullmatch`): with `$`, "nl\n" would pass, since `$` also
# matches before a trailing newline.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}")
MAX_READ_LIMIT: Final = 1000
DEFAULT_READ_LIMIT: Final = 500
MAX_FACTS_PER_APPEND: Final = 256
# A decision's note is for people reading the session, not a document.
MAX_APPROVAL_NOTE_CHARS: Final = 4096


@dataclass(frozen=True)
class NewFact:
    """A validated fact, not yet committed."""

    kind: str
    data: Mapping[str, Any]


@dataclass(frozen=True)
class CommittedFact:
    session_id: str
    seq: int
    kind: str
    data: Mapping[str, Any]
    timestamp_ms: int
    epoch: int


def check_id(value: str, what: str) -> str:
    if not _ID.fullmatch(value):
        raise InvalidId(
            f"{what} must be 1-128 characters of letters, digits, '_.:-', got {value[:140]!r}",
            field=what,
        )
    return value


def check_cursor(after_seq: int) -> int:
    if after_seq < 0:
        raise InvalidCursor(f"cursor must be >= 0, got {after_seq}")
    return after_seq


def check_limit(limit: int) -> int:
    if limit < 0:
        raise InvalidCursor(f"limit must be >= 0, got {limit}")
    return min(limit or DEFAULT_READ_LIMIT, MAX_READ_LIMIT)


def _require(data: Mapping[str, Any], key: str, kind: str, types: type | tuple[type, ...]) -> Any:
    value = data.get(key)
    # bool is an int subclass; an int field must not accept True.
    if (
        value is None
        or not isinstance(value, types)
        or (
            isinstance(value, bool)
            and bool not in (types if isinstance(types, tuple) else (types,))
        )
    ):
        raise InvalidFact(f"{kind}.{key} is required and must be {_type_name(types)}", field=key)
    return value


def _optional(data: Mapping[str, Any], key: str, kind: str, types: type | tuple[type, ...]) -> Any:
    if data.get(key) is None:
        return None
    return _require(data, key, kind, types)


def _type_name(types: type | tuple[type, ...]) -> str:
    if isinstance(types, tuple):
        return " or ".join(t.__name__ for t in types)
    return types.__name__


def _positive_ints(values: Any, kind: str, key: str) -> None:
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values
    ):
        raise InvalidFact(f"{kind}.{key} must be a list of positive integers", field=key)


def _check_input(data: Mapping[str, Any]) -> None:
    _require(data, "text", INPUT, str)
    check_id(_require(data, "requestId", INPUT, str), "requestId")
    retry_of = _optional(data, "retryOf", INPUT, int)
    if retry_of is not None and retry_of <= 0:
        raise InvalidFact("input.retryOf must be a positive seq", field="retryOf")
    blobs = _optional(data, "blobs", INPUT, list)
    if blobs is not None and not all(isinstance(b, str) for b in blobs):
        raise InvalidFact("input.blobs must be a list of blob ids", field="blobs")


def _check_epoch_started(data: Mapping[str, Any]) -> None:
    if _require(data, "epoch", EPOCH_STARTED, int) <= 0:
        raise InvalidFact("epoch_started.epoch must be positive", field="epoch")
    _require(data, "runtimeId", EPOCH_STARTED, str)
    _require(data, "attemptId", EPOCH_STARTED, str)
    if _require(data, "watermark", EPOCH_STARTED, int) < 0:
        raise InvalidFact("epoch_started.watermark must be >= 0", field="watermark")
    revision = _optional(data, "loadoutRevision", EPOCH_STARTED, int)
    if revision is not None and revision < 0:
        raise InvalidFact("epoch_started.loadoutRevision must be >= 0", field="loadoutRevision")


def _check_assistant(data: Mapping[str, Any]) -> None:
    check_id(_require(data, "generationId", ASSISTANT, str), "generationId")
    _optional(data, "content", ASSISTANT, list)
    calls = _optional(data, "toolCalls", ASSISTANT, list) or []
    seen: set[str] = set()
    for call in calls:
        if not isinstance(call, dict):
            raise InvalidFact("assistant.toolCalls items must be objects", field="toolCalls")
        call_id = check_id(_require(call, "id", "toolCall", str), "toolCall.id")
        _require(call, "name", "toolCall", str)
        _optional(call, "arguments", "toolCall", dict)
        # The model's arguments as sent, when they were not a JSON object:
        # kept so the call is never run with arguments the model did not give.
        _optional(call, "argumentsText", "toolCall", str)
        if call_id in seen:
            raise InvalidFact(f"tool call id {call_id!r} repeated", field="toolCalls")
        seen.add(call_id)
    if data.get("inputSeqs") is not None:
        _positive_ints(data["inputSeqs"], ASSISTANT, "inputSeqs")


def _check_tool_result(data: Mapping[str, Any]) -> None:
    check_id(_require(data, "toolCallId", TOOL_RESULT, str), "toolCallId")
    _optional(data, "isError", TOOL_RESULT, bool)


def _check_approval_requested(data: Mapping[str, Any]) -> None:
    check_id(_require(data, "toolCallId", APPROVAL_REQUESTED, str), "toolCallId")
    _require(data, "name", APPROVAL_REQUESTED, str)
    _require(data, "arguments", APPROVAL_REQUESTED, dict)


def _check_approval(data: Mapping[str, Any]) -> None:
    check_id(_require(data, "toolCallId", APPROVAL, str), "toolCallId")
    _require(data, "approve", APPROVAL, bool)
    note = _optional(data, "note", APPROVAL, str)
    if note is not None and len(note) > MAX_APPROVAL_NOTE_CHARS:
        raise InvalidFact(
            f"approval.note is longer than {MAX_APPROVAL_NOTE_CHARS} characters", field="note"
        )
    if not _require(data, "by", APPROVAL, str):
        raise InvalidFact("approval.by must name who decided", field="by")


def _check_compaction(data: Mapping[str, Any]) -> None:
    _require(data, "summary", COMPACTION, str)
    if _require(data, "firstKept", COMPACTION, int) <= 0:
        raise InvalidFact("compaction.firstKept must be a positive seq", field="firstKept")


def _check_attempt_failed(data: Mapping[str, Any]) -> None:
    _require(data, "error", ATTEMPT_FAILED, str)


def _check_parked(data: Mapping[str, Any]) -> None:
    _require(data, "reason", SESSION_PARKED, str)


def _check_compaction_failed(data: Mapping[str, Any]) -> None:
    _require(data, "error", COMPACTION_FAILED, str)


_CHECKS = {
    INPUT: _check_input,
    EPOCH_STARTED: _check_epoch_started,
    ASSISTANT: _check_assistant,
    TOOL_RESULT: _check_tool_result,
    COMPACTION: _check_compaction,
    ATTEMPT_FAILED: _check_attempt_failed,
    CANCELLED: lambda data: None,
    SESSION_PARKED: _check_parked,
    COMPACTION_FAILED: _check_compaction_failed,
    APPROVAL_REQUESTED: _check_approval_requested,
    APPROVAL: _check_approval,
}


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
    try:
        data = json.loads(data_json or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidFact(f"{kind} data is not JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise InvalidFact(f"{kind} data must be a JSON object")
    _CHECKS[kind](data)
    return NewFact(kind=kind, data=data)


def input_fingerprint(data: Mapping[str, Any]) -> str:
    """What makes two inputs with one request id "the same body"."""
    return json.dumps(
        [data.get("text"), data.get("retryOf"), data.get("blobs") or []],
        sort_keys=True,
        ensure_ascii=False,
    )
