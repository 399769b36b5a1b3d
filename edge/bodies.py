"""The JSON bodies the edge accepts, one msgspec struct per body.

A body is decoded once, straight into its struct: types, required fields,
bounds and unknown fields are checked in that one pass, and a refusal is a
400 naming the field and the problem. A field not in the struct is refused
by name: a misspelt `requestID` silently ignored would turn an idempotent
request into a duplicating one. Rules that need more than a field's type
(an id's syntax, a blob that must exist) stay with the operation.

The gRPC front door builds the same structs from its messages (`convert`),
so both doors refuse a bad value the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from typing import Annotated, Any, Final, TypeVar

import msgspec

from edge.errors import BadRequest, shown
from services.ledger.facts import MAX_APPROVAL_NOTE_CHARS, Multitask

MAX_INT64: Final = (1 << 63) - 1
MAX_TEXT_CHARS: Final = 256 * 1024
# Each blob is shown to the model in every request of the session; far more
# than any message needs, far less than a fact may hold.
MAX_BLOBS_PER_INPUT: Final = 64

Seq = Annotated[int, msgspec.Meta(gt=0, le=MAX_INT64)]
Milliseconds = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]


class Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel", gc=False):
    """Base of every request body. An optional field sent as null is absent,
    as it always was, unless the field says otherwise."""


class CreateSessionBody(Body, frozen=True):
    id: str | None = None


class InputBody(Body, frozen=True):
    text: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
    request_id: str | None = None
    blobs: Annotated[list[str], msgspec.Meta(max_length=MAX_BLOBS_PER_INPUT)] | None = None
    # The double-texting strategy (edge/multitask.py); None: the tenant's.
    multitask: Multitask | None = None


class ScheduleBody(Body, frozen=True):
    text: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TEXT_CHARS)]
    cron: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    timezone: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    at: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class ForkBody(Body, frozen=True):
    at: Seq
    # The fork's id (a new one when absent).
    id: str | None = None


class EditBody(Body, frozen=True):
    seq: Seq
    text: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
    request_id: str | None = None


class RetryBody(Body, frozen=True):
    seq: Seq
    request_id: str | None = None


class DecisionBody(Body, frozen=True):
    tool_call_id: str
    approve: bool
    note: Annotated[str, msgspec.Meta(max_length=MAX_APPROVAL_NOTE_CHARS)] | None = None


class CreateTenantBody(Body, frozen=True):
    id: str
    name: str = ""


class CreateKeyBody(Body, frozen=True):
    tenant: str | None = None
    admin: bool = False
    operator: bool = False


class CreateBlobBody(Body, frozen=True):
    length: int
    content_type: str = "application/octet-stream"


class DrainBody(Body, frozen=True):
    # Checked by the operation (a message listing the modes quotes no
    # client value at length, which msgspec's enum refusal would).
    mode: str = "handoff"
    # Absent: the edge's configured drain deadline.
    deadline_ms: Milliseconds | msgspec.UnsetType = msgspec.UNSET
    runtime_id: str | None = None


class UndoDrainBody(Body, frozen=True):
    runtime_id: str | None = None


class LocalDrainBody(DrainBody, frozen=True):
    undo: bool = False


B = TypeVar("B", bound=Body)


@cache
def _decoder(schema: type[B]) -> msgspec.json.Decoder[B]:
    return msgspec.json.Decoder(schema)


def decode(raw: bytes, schema: type[B]) -> B:
    """The body as `schema` ({} for an empty body), or a 400 saying why not."""
    try:
        body: B = _decoder(schema).decode(raw or b"{}")
    except msgspec.ValidationError as error:
        raise refusal(error, schema) from None
    except (msgspec.DecodeError, RecursionError):
        # Malformed, not UTF-8, or a lone surrogate (which parses in some
        # decoders but cannot be stored as UTF-8).
        raise BadRequest("the body is not valid JSON") from None
    return body


def convert(body: B | Mapping[str, Any], schema: type[B]) -> B:
    """A body the gRPC front door built from its message, checked as the
    HTTP door checks a decoded one."""
    if isinstance(body, schema):
        return body
    try:
        return msgspec.convert(body, schema)
    except msgspec.ValidationError as error:
        raise refusal(error, schema) from None


# msgspec's messages: "<problem>" or "<problem> - at `$.a.b[0]`".
_AT = re.compile(r"(?P<problem>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?", re.DOTALL)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>.*)`", re.DOTALL)
_MISSING = re.compile(r"Object missing required field `(?P<name>[^`]*)`")
_NOT_AN_OBJECT = re.compile(r"Expected `object`, got `[a-z]+`")


def refusal(error: msgspec.ValidationError, schema: type[Body]) -> BadRequest:
    said = _AT.fullmatch(str(error))
    assert said is not None  # the pattern matches any text
    problem, path = said["problem"], said["path"] or ""
    if not path and _NOT_AN_OBJECT.fullmatch(problem):
        return BadRequest("the body must be a JSON object")
    unknown = _UNKNOWN.fullmatch(problem)
    if unknown is not None:
        # The name is the client's: quoted cut short, never at length.
        allowed = ", ".join(sorted(schema.__struct_encode_fields__)) or "none"
        return BadRequest(f"unknown field {shown(unknown['name'])}; the fields are: {allowed}")
    missing = _MISSING.fullmatch(problem)
    if missing is not None:
        field = f"{path}.{missing['name']}" if path else missing["name"]
        return BadRequest(f"{field} is required", field=field)
    problem = problem[:1].lower() + problem[1:]
    if not path:
        return BadRequest(f"the body: {problem}")
    return BadRequest(f"{path}: {problem}", field=path)
