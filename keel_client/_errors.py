"""Every error the client raises, one class per reason the edge reports::

    KeelClientError                   .reason .code .field .metadata
     ├── Unauthenticated              no key, an unknown or a revoked key
     ├── PermissionDenied             the key may not do this (not an admin)
     ├── NotFound
     │    └── SessionNotFound         no such session in the key's tenant
     ├── InvalidArgument              a bad request; `.field` names what
     │    ├── SeqOutOfRange           a seq past the session's head
     │    └── InvalidLoadout          a loadout document the schema refuses
     ├── Conflict
     │    ├── IdempotencyConflict     a request id reused for another input
     │    ├── SessionExists           the session id is taken
     │    ├── RevisionMismatch        put_loadout's expected_revision is stale
     │    ├── ApprovalNotPending      no such tool call waits for a decision
 │    ├── SessionNotParked        skip_inputs of a session not parked on an input
 │    ├── SessionBusy             a "reject" input while the session owes work
     │    └── ApprovalAlreadyDecided  decided before: the first decision stands
     │                                (`.metadata` has its `seq` and `approve`)
     ├── PayloadTooLarge
     ├── Unavailable                  the edge or a service behind it is down;
     │    │                           retrying later may work (`.retry_after_s`)
     │    ├── DeadlineExceeded        the call's timeout passed
     │    └── ReconnectGaveUp         events() stopped reconnecting
     ├── StreamOutOfOrder             events() got a fact that is not last + 1
     ├── ClientClosed                 the client was closed under a waiting call
     └── ServerError                  a bug on the server (INTERNAL, UNKNOWN, ...)

The edge sends a google.rpc.Status whose ErrorInfo carries the reason
(`SESSION_NOT_FOUND`, ...) and metadata (`field`, `seq`, ...).
`error_from_rpc` is the one place a failed call becomes one of these: by the
reason when the class is known, else by the status code, so a reason added to
the server later still lands under the right parent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


class KeelClientError(Exception):
    """Root of every error of the Keel client."""

    # The reasons this class stands for; the first is its default.
    reasons: ClassVar[tuple[str, ...]] = ("UNKNOWN",)
    # The status codes that fall back on this class when the reason is unknown.
    codes: ClassVar[tuple[grpc.StatusCode, ...]] = ()

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        code: grpc.StatusCode | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.reasons[0]
        # None for errors the client itself detects (no call failed).
        self.code = code
        self.metadata: Mapping[str, str] = dict(metadata or {})

    @property
    def field(self) -> str | None:
        """The request field (or loadout path) the server refused, if it said."""
        return self.metadata.get("field")

    def __str__(self) -> str:
        where = f" ({self.field})" if self.field else ""
        return f"{self.reason}{where}: {self.message}"


class Unauthenticated(KeelClientError):
    reasons = ("UNAUTHENTICATED", "INVALID_API_KEY")
    codes = (grpc.StatusCode.UNAUTHENTICATED,)


class PermissionDenied(KeelClientError):
    reasons = ("PERMISSION_DENIED", "FORBIDDEN")
    codes = (grpc.StatusCode.PERMISSION_DENIED,)


class NotFound(KeelClientError):
    reasons = ("NOT_FOUND",)
    codes = (grpc.StatusCode.NOT_FOUND,)


class SessionNotFound(NotFound):
    reasons = ("SESSION_NOT_FOUND",)


class InvalidArgument(KeelClientError):
    reasons: ClassVar[tuple[str, ...]] = (
        "INVALID_ARGUMENT",
        "BAD_REQUEST",
        "INVALID_ID",
        "INVALID_CURSOR",
        "INVALID_FACT",
    )
    codes: ClassVar[tuple[grpc.StatusCode, ...]] = (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
    )


class SeqOutOfRange(InvalidArgument):
    reasons = ("SEQ_OUT_OF_RANGE",)


class InvalidLoadout(InvalidArgument):
    reasons = ("INVALID_LOADOUT",)


class Conflict(KeelClientError):
    reasons: ClassVar[tuple[str, ...]] = ("CONFLICT",)
    codes: ClassVar[tuple[grpc.StatusCode, ...]] = (
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.FAILED_PRECONDITION,
    )


class IdempotencyConflict(Conflict):
    reasons = ("IDEMPOTENCY_CONFLICT",)


class SessionExists(Conflict):
    reasons = ("SESSION_EXISTS",)


class RevisionMismatch(Conflict):
    reasons = ("REVISION_MISMATCH",)


class ApprovalNotPending(Conflict):
    reasons = ("APPROVAL_NOT_PENDING",)


class SessionNotParked(Conflict):
    reasons = ("SESSION_NOT_PARKED",)


class SessionBusy(Conflict):
    reasons = ("SESSION_BUSY",)


class ApprovalAlreadyDecided(Conflict):
    reasons = ("APPROVAL_ALREADY_DECIDED",)


class PayloadTooLarge(KeelClientError):
    reasons = ("PAYLOAD_TOO_LARGE", "FACT_TOO_LARGE")
    codes = (grpc.StatusCode.RESOURCE_EXHAUSTED,)


class Unavailable(KeelClientError):
    reasons: ClassVar[tuple[str, ...]] = ("UNAVAILABLE", "DRAINING")
    # CANCELLED reaches a caller only when the server dropped the call (this
    # client never cancels a call it still waits on): the edge went away.
    codes: ClassVar[tuple[grpc.StatusCode, ...]] = (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
    )

    @property
    def retry_after_s(self) -> float | None:
        """How long the server asked callers to wait (google.rpc.RetryInfo)."""
        value = self.metadata.get("retry_after_s")
        return float(value) if value is not None else None


class DeadlineExceeded(Unavailable):
    reasons = ("DEADLINE_EXCEEDED",)
    codes = (grpc.StatusCode.DEADLINE_EXCEEDED,)


class ReconnectGaveUp(Unavailable):
    """No event stream could be opened for the policy's `give_up_after_s`.

    `last_seq` is the seq of the last fact yielded: `events(after=last_seq)`
    carries on later with nothing missed.
    """

    reasons = ("RECONNECT_GAVE_UP",)

    def __init__(self, message: str, *, last_seq: int) -> None:
        super().__init__(message, metadata={"last_seq": str(last_seq)})
        self.last_seq = last_seq


class StreamOutOfOrder(KeelClientError):
    """The server sent a fact that is not the one after the last yielded.

    A fact twice or a gap would break every consumer that folds facts into
    state, so the iterator stops instead of passing it on.
    """

    reasons = ("STREAM_OUT_OF_ORDER",)

    def __init__(self, message: str, *, expected_seq: int, got_seq: int) -> None:
        super().__init__(
            message, metadata={"expected_seq": str(expected_seq), "got_seq": str(got_seq)}
        )
        self.expected_seq = expected_seq
        self.got_seq = got_seq


class ClientClosed(KeelClientError):
    """The client was closed: calls and iterators still waiting on it end
    with this (closing a `KeelClient` from another thread wakes them)."""

    reasons = ("CLIENT_CLOSED",)


class ServerError(KeelClientError):
    reasons = ("INTERNAL",)
    codes = (
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.DATA_LOSS,
    )


def _subclasses(root: type[KeelClientError]) -> list[type[KeelClientError]]:
    found = [root]
    for child in root.__subclasses__():
        found.extend(_subclasses(child))
    return found


# Parents are listed before children, so a code maps to the most general
# class that claims it (DEADLINE_EXCEEDED is the exception, claimed only there).
_CLASSES = _subclasses(KeelClientError)
_BY_REASON: dict[str, type[KeelClientError]] = {
    reason: cls for cls in _CLASSES for reason in cls.reasons
}
_BY_CODE: dict[grpc.StatusCode, type[KeelClientError]] = {}
for _cls in _CLASSES:
    for _code in _cls.codes:
        _BY_CODE.setdefault(_code, _cls)


def _status_of(err: grpc.RpcError) -> status_pb2.Status | None:
    try:
        return rpc_status.from_call(err)  # type: ignore[arg-type]
    except ValueError:
        # A status detail that contradicts the call's own code or message:
        # trust the call.
        return None


def error_from_rpc(err: grpc.RpcError) -> KeelClientError:
    """The client error for a failed call (aio or sync)."""
    code: grpc.StatusCode = err.code()
    message: str = err.details() or code.name
    reason = ""
    metadata: dict[str, str] = {}
    status = _status_of(err)
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        retry = error_details_pb2.RetryInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info):
            reason = reason or info.reason
            metadata.update(info.metadata)
        elif detail.Is(retry.DESCRIPTOR) and detail.Unpack(retry):
            metadata["retry_after_s"] = str(retry.retry_delay.ToTimedelta().total_seconds())
    cls = _BY_REASON.get(reason) or _BY_CODE.get(code, ServerError)
    if cls in (ReconnectGaveUp, StreamOutOfOrder, ClientClosed):
        # Reasons of the client's own making never come from a server.
        cls = _BY_CODE.get(code, ServerError)
    return cls(message, reason=reason or code.name, code=code, metadata=metadata)
