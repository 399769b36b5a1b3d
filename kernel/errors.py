"""Errors of the kernel service, each with its gRPC code and reason::

    KernelError                UNKNOWN              KERNEL_ERROR
     ├── InvalidArgument       INVALID_ARGUMENT     INVALID_ARGUMENT
     │    ├── InvalidLoadout   INVALID_ARGUMENT     INVALID_LOADOUT
     │    └── WeakApiKey       INVALID_ARGUMENT     WEAK_API_KEY
     ├── UnknownSession        NOT_FOUND            SESSION_NOT_FOUND
     ├── UnknownTenant         NOT_FOUND            UNKNOWN_TENANT
     ├── UnknownRuntime        NOT_FOUND            UNKNOWN_RUNTIME
     ├── LoadoutNotFound       NOT_FOUND            LOADOUT_NOT_FOUND
     ├── ApiKeyNotFound        NOT_FOUND            API_KEY_NOT_FOUND
     ├── EpochSuperseded       FAILED_PRECONDITION  STALE_EPOCH
     ├── LeaseLost             FAILED_PRECONDITION  LEASE_LOST
     ├── RevisionMismatch      FAILED_PRECONDITION  REVISION_MISMATCH
     ├── ApiKeyExists          ALREADY_EXISTS       API_KEY_EXISTS
     └── InvalidApiKey         UNAUTHENTICATED      INVALID_API_KEY

`EpochSuperseded` means the caller's epoch is not the session's current one (a
successor claimed it); `LeaseLost` means the epoch is current but the lease
is no longer the caller's to use (expired, released, finished, or never
issued). Either way the caller must stop working on the session. Metadata
carries the details machine-readably (`current_epoch`, `state`, `field`…).
"""

from __future__ import annotations

import grpc

from services.common.errors import KeelError


class KernelError(KeelError):
    """Root of every error the kernel reports."""

    code = grpc.StatusCode.UNKNOWN
    reason = "KERNEL_ERROR"


class InvalidArgument(KernelError):
    """A malformed request: empty or bad ids, negative waits, bad documents."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class InvalidLoadout(InvalidArgument):
    """A loadout document the schema refuses; `field` names where (e.g.
    "model.provider", "tools[1].transport")."""

    reason = "INVALID_LOADOUT"


class WeakApiKey(InvalidArgument):
    """A caller-chosen API key too short or too uniform to be safe (or not
    printable); `field` is "key"."""

    reason = "WEAK_API_KEY"


class UnknownSession(KernelError):
    """The kernel has never seen this session (it was never enqueued)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "SESSION_NOT_FOUND"


class UnknownTenant(KernelError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "UNKNOWN_TENANT"


class UnknownRuntime(KernelError):
    """The runtime never registered (RegisterRuntime comes first)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "UNKNOWN_RUNTIME"


class LoadoutNotFound(KernelError):
    """The tenant has no loadout with that revision."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "LOADOUT_NOT_FOUND"


class ApiKeyNotFound(KernelError):
    """No key has this key id (revoking one needs its id, not the key)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "API_KEY_NOT_FOUND"


class EpochSuperseded(KernelError):
    """The session was claimed again since this epoch was issued."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "STALE_EPOCH"


class LeaseLost(KernelError):
    """The lease of this epoch is no longer the caller's (expired, released…)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "LEASE_LOST"


class RevisionMismatch(KernelError):
    """A put that expected another latest loadout revision (someone else
    wrote one since the caller read it); metadata `current_revision`."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "REVISION_MISMATCH"


class ApiKeyExists(KernelError):
    """A caller-chosen key is already registered to another tenant."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "API_KEY_EXISTS"


class InvalidApiKey(KernelError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "INVALID_API_KEY"
