"""Errors of the compaction service, each with its gRPC code and reason::

    CompactionError            UNKNOWN              COMPACTION_ERROR
     ├── InvalidArgument       INVALID_ARGUMENT     INVALID_ARGUMENT
     │    └── SeqPastHead      OUT_OF_RANGE         SEQ_OUT_OF_RANGE
     ├── NoSessionToCompact    NOT_FOUND            SESSION_NOT_FOUND
     ├── CompactionFenced      FAILED_PRECONDITION  STALE_EPOCH
     ├── BadLoadout            FAILED_PRECONDITION  BAD_LOADOUT
     └── SummaryFailed         UNAVAILABLE          SUMMARY_FAILED

`CompactionFenced` means the caller's epoch is not the session's current fence: a
newer attempt owns the session and the caller must stop (the ledger refused,
or would refuse, the compaction fact). `SummaryFailed` means the summarizing
model gave no usable summary; nothing was committed and the caller decides
whether to count it as a failed compaction. A skipped compaction (nothing to
compact, or a summary that would not shrink the context) is not an error.
"""

from __future__ import annotations

import grpc

from services.common.errors import KeelError


class CompactionError(KeelError):
    """Root of every error the compaction service reports."""

    code = grpc.StatusCode.UNKNOWN
    reason = "COMPACTION_ERROR"


class InvalidArgument(CompactionError):
    """A malformed request: bad ids, a negative seq or epoch, an unknown reason."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class SeqPastHead(InvalidArgument):
    """A seq past the session's head: there is no such point in the session yet."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "SEQ_OUT_OF_RANGE"


class NoSessionToCompact(CompactionError):
    """The ledger has no session of that id."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "SESSION_NOT_FOUND"


class CompactionFenced(CompactionError):
    """The caller's epoch is not the session's current one."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "STALE_EPOCH"


class BadLoadout(CompactionError):
    """The tenant's loadout cannot drive a compaction (unknown tenant, invalid
    compaction settings or model configuration)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "BAD_LOADOUT"


class SummaryFailed(CompactionError):
    """The summarizing model failed or answered with an empty summary."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "SUMMARY_FAILED"
