"""The shape of each appendable fact kind's data, as msgspec structs.

The kind travels beside the data (`NewFact.kind`), not inside it, so the
struct is chosen by kind (`SCHEMAS`) rather than by a tag in the object: the
same as a tagged union on `kind`, without writing the tag into every fact.

One conversion validates a fact's types and constraints in C; rules one
field alone cannot state (an id's syntax, a tool call id used twice in one
answer) run in `__post_init__`, during that conversion. Fields a kind does
not name (an assistant's `usage`, a tool result's `content`, an input's
`traceparent`) are allowed and kept: the ledger stores the data as sent, and
these structs only judge it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

import msgspec

from services.ledger.errors import InvalidFact, InvalidId

# Matched whole (`fullmatch`): with `$`, "nl\n" would pass, since `$` also
# matches before a trailing newline.
ID_CHARS: Final = r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}"
_ID = re.compile(ID_CHARS)
# A decision's note is for people reading the session, not a document.
MAX_APPROVAL_NOTE_CHARS: Final = 4096

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
Note = Annotated[str, msgspec.Meta(max_length=MAX_APPROVAL_NOTE_CHARS)]


def check_id(value: str, what: str) -> str:
    if not _ID.fullmatch(value):
        raise InvalidId(
            f"{what} must be 1-128 characters of letters, digits, '_.:-', got {value[:140]!r}",
            field=what,
        )
    return value


class FactData(msgspec.Struct, frozen=True, rename="camel", gc=False):
    """Base of every kind's data. Not tracked by the garbage collector: data
    decoded from JSON holds no reference cycles."""


class InputData(FactData, frozen=True):
    text: str
    request_id: str
    retry_of: PositiveInt | None = None
    blobs: list[str] | None = None
    # What was asked of work already under way when it came (the edge's
    # `multitask`); absent for the default, `enqueue`.
    multitask: Literal["enqueue", "reject", "interrupt", "rollback"] | None = None

    def __post_init__(self) -> None:
        check_id(self.request_id, "requestId")


class EpochStartedData(FactData, frozen=True):
    epoch: PositiveInt
    runtime_id: str
    attempt_id: str
    watermark: NonNegativeInt
    loadout_revision: NonNegativeInt | None = None


class ToolCallData(FactData, frozen=True):
    id: str
    name: str
    arguments: dict[str, Any] | None = None
    # The model's arguments as sent, when they were not a JSON object:
    # kept so the call is never run with arguments the model did not give.
    arguments_text: str | None = None

    def __post_init__(self) -> None:
        check_id(self.id, "toolCall.id")


class AssistantData(FactData, frozen=True):
    generation_id: str
    content: list[Any] | None = None
    tool_calls: list[ToolCallData] | None = None
    input_seqs: list[PositiveInt] | None = None
    # The inputs read, when its epoch's epoch_started is an earlier turn's
    # (a sticky session woken with the epoch it kept).
    watermark: NonNegativeInt | None = None

    def __post_init__(self) -> None:
        check_id(self.generation_id, "generationId")
        calls = self.tool_calls
        if calls and len({call.id for call in calls}) != len(calls):
            seen: set[str] = set()
            for call in calls:
                if call.id in seen:
                    raise InvalidFact(f"tool call id {call.id!r} repeated", field="toolCalls")
                seen.add(call.id)


class ToolResultData(FactData, frozen=True):
    tool_call_id: str
    is_error: bool | None = None

    def __post_init__(self) -> None:
        check_id(self.tool_call_id, "toolCallId")


class ApprovalRequestedData(FactData, frozen=True):
    tool_call_id: str
    name: str
    arguments: dict[str, Any]

    def __post_init__(self) -> None:
        check_id(self.tool_call_id, "toolCallId")


class ApprovalData(FactData, frozen=True):
    tool_call_id: str
    approve: bool
    # Who decided: never empty.
    by: NonEmptyStr
    note: Note | None = None

    def __post_init__(self) -> None:
        check_id(self.tool_call_id, "toolCallId")


class CompactionData(FactData, frozen=True):
    summary: str
    first_kept: PositiveInt
    # As AssistantData.watermark: the inputs read, from a later sticky turn.
    watermark: NonNegativeInt | None = None


class AttemptFailedData(FactData, frozen=True):
    error: str


class CancelledData(FactData, frozen=True):
    reason: str | None = None
    # A rollback's cancel names the input committed with it: a retried
    # rollback (that input known already) commits no second cancel.
    request_id: str | None = None

    def __post_init__(self) -> None:
        if self.request_id is not None:
            check_id(self.request_id, "requestId")


class SessionParkedData(FactData, frozen=True):
    reason: str
    # The inputs the failing attempt was answering (absent in older facts).
    input_seqs: list[PositiveInt] | None = None


class InputsSkippedData(FactData, frozen=True):
    # Inputs the session was parked on; each must still be owed.
    input_seqs: list[PositiveInt]
    # Why they failed, as the model is told.
    reason: str

    def __post_init__(self) -> None:
        if not self.input_seqs:
            raise InvalidFact("inputs_skipped.inputSeqs names no input", field="inputSeqs")


class CompactionFailedData(FactData, frozen=True):
    error: str


SCHEMAS: Final[dict[str, type[FactData]]] = {
    "input": InputData,
    "epoch_started": EpochStartedData,
    "assistant": AssistantData,
    "tool_result": ToolResultData,
    "compaction": CompactionData,
    "attempt_failed": AttemptFailedData,
    "cancelled": CancelledData,
    "session_parked": SessionParkedData,
    "compaction_failed": CompactionFailedData,
    "approval_requested": ApprovalRequestedData,
    "approval": ApprovalData,
    "inputs_skipped": InputsSkippedData,
}

# msgspec's messages: "<problem>" or "<problem> - at `$.a.b[0]`".
_AT = re.compile(r"(?P<problem>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?", re.DOTALL)
_MISSING = re.compile(r"Object missing required field `(?P<name>[^`]*)`")


def refusal(kind: str, error: msgspec.ValidationError) -> InvalidFact:
    """msgspec's complaint as the ledger's InvalidFact, naming the field by
    its path in the data (`toolCalls[1].name`) and the problem."""
    said = _AT.fullmatch(str(error))
    assert said is not None  # the pattern matches any text
    problem, path = said["problem"], said["path"] or ""
    missing = _MISSING.fullmatch(problem)
    if missing is not None:
        field = f"{path}.{missing['name']}" if path else missing["name"]
        return InvalidFact(f"{kind}.{field} is required", field=field)
    problem = problem[:1].lower() + problem[1:]
    if not path:
        return InvalidFact(f"{kind} data: {problem}")
    return InvalidFact(f"{kind}.{path}: {problem}", field=path)
