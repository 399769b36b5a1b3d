"""Errors of the ledger service, each with its gRPC code and reason::

LedgerError
 ├── SessionNotFound        NOT_FOUND            SESSION_NOT_FOUND
 ├── SessionExists          ALREADY_EXISTS       SESSION_EXISTS
 ├── InvalidFact            INVALID_ARGUMENT     INVALID_FACT
 │    └── FactTooLarge      INVALID_ARGUMENT     FACT_TOO_LARGE
 ├── InvalidCursor          INVALID_ARGUMENT     INVALID_CURSOR
 ├── InvalidId              INVALID_ARGUMENT     INVALID_ID
 ├── InvalidSettlement      INVALID_ARGUMENT     INVALID_SETTLEMENT
 ├── StaleEpoch             FAILED_PRECONDITION  STALE_EPOCH
 ├── SessionBusy            FAILED_PRECONDITION  SESSION_BUSY
 ├── IdempotencyConflict    ALREADY_EXISTS       IDEMPOTENCY_CONFLICT
 ├── UnknownToolCall        FAILED_PRECONDITION  UNKNOWN_TOOL_CALL
 ├── ApprovalNotPending     FAILED_PRECONDITION  APPROVAL_NOT_PENDING
 ├── ApprovalDecided        ALREADY_EXISTS       APPROVAL_ALREADY_DECIDED
 └── WriteContention        ABORTED              WRITE_CONTENTION
"""

from __future__ import annotations

import grpc

from services.common.errors import KeelError


class LedgerError(KeelError):
    """Root of every error the ledger reports."""

    code = grpc.StatusCode.UNKNOWN
    reason = "LEDGER_ERROR"


class SessionNotFound(LedgerError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "SESSION_NOT_FOUND"


class SessionExists(LedgerError):
    """The id is taken by a session of another tenant."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "SESSION_EXISTS"


class InvalidFact(LedgerError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_FACT"


class FactTooLarge(InvalidFact):
    reason = "FACT_TOO_LARGE"


class InvalidCursor(LedgerError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_CURSOR"


class InvalidId(LedgerError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ID"


class InvalidSettlement(LedgerError):
    """An append's `settle` that cannot be a runner's Finish (no epoch,
    a negative number)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_SETTLEMENT"


class StaleEpoch(LedgerError):
    """A runner wrote with an epoch that is not the stream's current fence."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "STALE_EPOCH"


class SessionBusy(LedgerError):
    """An append asked to commit only while the session owes nothing (a
    `reject` input) found work owed."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "SESSION_BUSY"


class IdempotencyConflict(LedgerError):
    """The request id was already used for a different input."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "IDEMPOTENCY_CONFLICT"


class UnknownToolCall(LedgerError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "UNKNOWN_TOOL_CALL"


class ApprovalNotPending(LedgerError):
    """A decision for a tool call that does not wait for one: no such call,
    no approval was requested for it, or it has a result already."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "APPROVAL_NOT_PENDING"


class ApprovalDecided(LedgerError):
    """A second decision for one tool call: the first one stands (its seq
    and whether it approved are in the metadata)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "APPROVAL_ALREADY_DECIDED"


class WriteContention(LedgerError):
    """Another ledger process kept winning the race for this stream."""

    code = grpc.StatusCode.ABORTED
    reason = "WRITE_CONTENTION"
