"""The error root every Keel service derives its own from.

A service raises subclasses of its root; the gRPC layer turns them into a
status code plus a `google.rpc.ErrorInfo` detail whose `reason` is
machine-readable (`STALE_EPOCH`, `LEASE_LOST`, ...). Typed clients turn the
status back into the same class, so callers catch exceptions, not codes::

    KeelError
     ├── LedgerError   (services.ledger.errors)
     ├── KernelError   (kernel.errors)
     ├── RunnerError   (services.runner.errors)
     └── CompactionError (compaction.errors)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, ClassVar, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

log = logging.getLogger(__name__)

ERROR_DOMAIN = "keel.dev"
_DETAILS_KEY = "grpc-status-details-bin"


class KeelError(Exception):
    """Root of every error a Keel service reports on purpose."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    reason: ClassVar[str] = "UNKNOWN"

    def __init__(self, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = {k: str(v) for k, v in metadata.items()}

    def to_status(self) -> grpc.Status:
        return rich_status(self.code, self.reason, self.message, self.metadata)


def rich_status(
    code: grpc.StatusCode,
    reason: str,
    message: str,
    metadata: Mapping[str, str],
    retry_after_ms: int = 0,
) -> grpc.Status:
    """A status with its ErrorInfo detail (and RetryInfo when the caller
    should come back after `retry_after_ms`), as every Keel server sends it."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)
    details = [any_pb2.Any()]
    details[0].Pack(info)
    if retry_after_ms > 0:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(retry_after_ms)
        details.append(any_pb2.Any())
        details[1].Pack(retry)
    status = status_pb2.Status(code=code.value[0], message=message, details=details)
    return rpc_status.to_status(status)


class InternalError(KeelError):
    """A bug: reported as INTERNAL, never with a traceback to the caller."""

    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"


class ServiceUnavailable(KeelError):
    """The service (or its store) cannot answer now; retrying later may work."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


class Unimplemented(KeelError):
    """The server does not have this method: an older version of the service
    (during a rolling upgrade, say). A caller with an older way to ask may
    fall back to it."""

    code = grpc.StatusCode.UNIMPLEMENTED
    reason = "UNIMPLEMENTED"


class DatabaseUnavailable(ServiceUnavailable):
    """The service's database cannot be reached. Every replica shares it, so
    the status tells gRPC's channel retries (services/common/rpc.py) not to
    send the call again elsewhere: the caller learns of the outage at once
    instead of after each replica has waited for a connection."""

    def to_status(self) -> grpc.Status:
        status: Any = super().to_status()
        # A negative pushback: "do not retry" (gRPC's retry design, A6).
        pushback = (("grpc-retry-pushback-ms", "-1"),)
        replaced: grpc.Status = status._replace(
            trailing_metadata=(*status.trailing_metadata, *pushback)
        )
        return replaced


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo detail a Keel service attached to a failed call."""
    metadata: Any = err.trailing_metadata() or ()
    for key, value in metadata:
        if key != _DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Is(info.DESCRIPTOR) and detail.Unpack(info):
                return info
    return None


E = TypeVar("E", bound=KeelError)


def error_from_rpc(
    err: grpc.aio.AioRpcError, root: type[E], by_reason: Mapping[str, type[E]]
) -> KeelError:
    """Turns a failed call back into the service's error class.

    Unknown reasons keep the service's root class so `except LedgerError`
    still catches them; transport failures become `ServiceUnavailable`.
    """
    info = error_info(err)
    message = err.details() or err.code().name
    if info is not None:
        return error_of_reason(err.code(), info.reason, message, info.metadata, root, by_reason)
    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ServiceUnavailable(message)
    if err.code() == grpc.StatusCode.UNIMPLEMENTED:
        return Unimplemented(message)
    generic = root.__new__(root)
    # A bare status (a cancelled call has details "CANCELLED") is said once.
    said = message if message == err.code().name else f"{err.code().name}: {message}"
    KeelError.__init__(generic, said)
    return generic


def error_of_reason(
    code: grpc.StatusCode,
    reason: str,
    message: str,
    metadata: Mapping[str, str],
    root: type[E],
    by_reason: Mapping[str, type[E]],
) -> KeelError:
    """The error class a refusal with this ErrorInfo `reason` means, whether
    it came as a call's status (`error_from_rpc`) or inside a message of a
    stream that answers many requests (the ledger's AppendStream)."""
    cls: type[KeelError] = by_reason.get(reason, root)
    if reason not in by_reason and code == grpc.StatusCode.UNAVAILABLE:
        # Another service's own "cannot answer now" (its database is
        # away): still retryable here, not a generic failure of the root.
        cls = ServiceUnavailable
    error = cls.__new__(cls)
    KeelError.__init__(error, message, **dict(metadata))
    return error


def reasons_of(root: type[KeelError]) -> dict[str, type[KeelError]]:
    """Every subclass of `root`, by its reason (for `error_from_rpc`)."""
    found: dict[str, type[KeelError]] = {}
    stack: list[type[KeelError]] = [root]
    while stack:
        cls = stack.pop()
        found.setdefault(cls.reason, cls)
        stack.extend(cls.__subclasses__())
    return found


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])
StreamHandler = TypeVar("StreamHandler", bound=Callable[..., AsyncIterator[Any]])
# Ends a call whose handler raised `error`: aborts `context` with a status.
Abort = Callable[[Any, Exception, str], Awaitable[None]]


def guarded(
    abort: Abort,
) -> tuple[Callable[[Handler], Handler], Callable[[StreamHandler], StreamHandler]]:
    """Decorators for unary and server-streaming handlers that turn whatever
    a handler raises into a status through `abort`. The internal services
    abort with their KeelError's status (`unary_errors`, `stream_errors`);
    the public API maps the edge's own refusals its way."""

    def unary(method: Handler) -> Handler:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: Any) -> Any:
            try:
                return await method(self, request, context)
            except Exception as error:
                await abort(context, error, method.__qualname__)

        return wrapper  # type: ignore[return-value]

    def streaming(method: StreamHandler) -> StreamHandler:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in method(self, request, context):
                    yield item
            except Exception as error:
                await abort(context, error, method.__qualname__)

        return wrapper  # type: ignore[return-value]

    return unary, streaming


def as_reported(error: Exception, handler: str) -> KeelError:
    """What a handler's exception tells the caller: a KeelError as it is,
    anything else (a bug) as INTERNAL, logged here with its traceback."""
    if isinstance(error, KeelError):
        return error
    log.error("unexpected error in %s", handler, exc_info=error)
    return InternalError("internal error; see the service log")


async def _abort(context: Any, error: Exception, handler: str) -> None:
    error = as_reported(error, handler)
    # abort_with_status attaches the ErrorInfo detail as trailing metadata.
    await context.abort_with_status(error.to_status())


# KeelError (and unexpected exceptions, as INTERNAL) of a handler -> a status.
unary_errors, stream_errors = guarded(_abort)
