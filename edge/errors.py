"""HTTP errors of the edge: every refusal is JSON `{error: {code, message}}`
with the right 4xx; a 500 is a bug::

    EdgeError
     ├── BadRequest          400  bad_request
     ├── Unauthorized        401  unauthorized
     ├── Forbidden           403  forbidden
     ├── NotFound            404  not_found
     │    └── SessionNotVisible  (ErrorInfo reason SESSION_NOT_FOUND)
     ├── MethodNotAllowed    405  method_not_allowed
     ├── Conflict            409  conflict  (request id reuse, wrong blob offset)
     │    ├── NotParked      409  not_parked  (a skip of a session that is not parked)
     │    └── Busy           409  session_busy  (a `reject` input while work is owed)
     ├── PreconditionFailed  412  precondition_failed  (If-Match: another revision)
     ├── RequestTimeout      408  request_timeout  (a body that stalled)
     ├── PayloadTooLarge     413  payload_too_large
     ├── TooManyRequests     429  too_many_requests
     │    ├── TooManyFailedKeys  (FAILED_KEYS_RATE_LIMITED, with Retry-After)
     │    └── TooManyStreams     (TOO_MANY_STREAMS, naming the limit)
     └── Unavailable         503  unavailable  (with Retry-After)

Service errors (`KeelError`) reach clients through `from_service_error`; the
app registers both roots as exception handlers, so routes only raise.

The gRPC API (keel.sessions.v1, edge/grpc_api.py) reports the same errors:
each class also names its gRPC code and the `ErrorInfo.reason` clients
branch on, and a service's refusal keeps the service's code, reason and
details (the `field` an invalid loadout names, the `seq` of a conflict).
"""

from __future__ import annotations

import re
from typing import ClassVar

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edge.refusals import REFUSALS
from services import blobs as blob_errors
from services.common.errors import KeelError, ServiceUnavailable
from services.ledger import errors as ledger_errors

# A refusal names what it refused, but never hands a long client value back:
# error messages end up in logs and UIs.
MAX_ECHO_CHARS = 64
# How long a 503 tells its client to wait: about what a pool takes to
# reconnect once its database is back (services/common/pg_pool.py).
UNAVAILABLE_RETRY_AFTER_S = 1


class EdgeError(Exception):
    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"
    # The same refusal on the gRPC API; an instance may carry a service's own.
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"

    # How long a caller should wait before trying again (0: not said); over
    # HTTP a Retry-After header, over gRPC a RetryInfo.
    retry_after_s: int = 0

    def __init__(self, message: str, *, reason: str = "", field: str = "") -> None:
        super().__init__(message)
        self.message = message
        if reason:
            self.reason = reason
        # Machine-readable details for ErrorInfo.metadata, e.g. the field refused.
        self.metadata: dict[str, str] = {"field": field} if field else {}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s > 0:
            return {"Retry-After": str(self.retry_after_s)}
        return {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.code, self.message, self.headers())


class BadRequest(EdgeError):
    status = 400
    code = "bad_request"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class Unauthorized(EdgeError):
    status = 401
    code = "unauthorized"
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class UnknownKey(Unauthorized):
    """The kernel knows no such key (or it was revoked): a failed key."""


class Forbidden(EdgeError):
    status = 403
    code = "forbidden"
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class NotFound(EdgeError):
    status = 404
    code = "not_found"
    grpc_code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class SessionNotVisible(NotFound):
    """Not the caller's session: another tenant's is not found either."""

    reason = "SESSION_NOT_FOUND"


class MethodNotAllowed(EdgeError):
    status = 405
    code = "method_not_allowed"
    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    reason = "UNIMPLEMENTED"


class Conflict(EdgeError):
    status = 409
    code = "conflict"
    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    reason = "CONFLICT"


class NotParked(Conflict):
    """A skip asked of a session that is not parked on a failed input."""

    code = "not_parked"
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "SESSION_NOT_PARKED"


class Busy(Conflict):
    """An input sent with `multitask: reject` while the session owes work."""

    code = "session_busy"
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "SESSION_BUSY"


class PreconditionFailed(EdgeError):
    """If-Match named another revision than the current one."""

    status = 412
    code = "precondition_failed"
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class RequestTimeout(EdgeError):
    """The body stopped arriving: the connection is closed after this answer
    (what is left of the body would be read as the next request)."""

    status = 408
    code = "request_timeout"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "REQUEST_TIMEOUT"

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class PayloadTooLarge(EdgeError):
    status = 413
    code = "payload_too_large"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "PAYLOAD_TOO_LARGE"


class TooManyRequests(EdgeError):
    status = 429
    code = "too_many_requests"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"


class TooManyFailedKeys(TooManyRequests):
    """This client address sent too many unknown keys lately."""

    code = "too_many_failed_keys"
    reason = "FAILED_KEYS_RATE_LIMITED"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.metadata = {"retry_after_s": str(retry_after_s)}


class TooManyStreams(TooManyRequests):
    """The key or its tenant holds as many event streams as it may."""

    code = "too_many_streams"
    reason = "TOO_MANY_STREAMS"

    def __init__(self, message: str, *, limit: str, maximum: int) -> None:
        super().__init__(message)
        self.metadata = {"limit": limit, "max": str(maximum)}


class Unavailable(EdgeError):
    """Nothing was done; the same request may succeed shortly. Always says
    when to come back (Retry-After, RetryInfo): a client that is not told
    tends to retry at once, and all of them together."""

    status = 503
    code = "unavailable"
    grpc_code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"
    retry_after_s = UNAVAILABLE_RETRY_AFTER_S


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": code, "message": message}}, status_code=status, headers=headers
    )


def shown(value: object) -> str:
    """A client's value as a message may quote it: repr, cut to MAX_ECHO_CHARS."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > MAX_ECHO_CHARS:
        return repr(text[:MAX_ECHO_CHARS]) + "..."
    return repr(text)


async def handle_edge_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, EdgeError)
    return error.response()


async def handle_service_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, KeelError)
    mapped = from_service_error(error)
    if mapped.status >= 500:
        # Counted with every answer; said once per outage (edge.refusals).
        REFUSALS.refused(f"{request.method} {request.url.path}: {error.message} ({error.reason})")
    return mapped.response()


def from_service_error(error: KeelError) -> EdgeError:
    """A service's refusal, as the error a client should see. Over gRPC it
    keeps the service's code, reason and metadata (its message may quote a
    client's long value, so the edge's own message replaces it), unless the
    edge reports it as unavailable (an unknown failure says nothing useful)."""
    mapped = _http_error_of(error)
    if not isinstance(mapped, Unavailable) or isinstance(error, ServiceUnavailable):
        mapped.grpc_code = error.code
        mapped.reason = error.reason
        mapped.metadata = dict(error.metadata)
    return mapped


def _http_error_of(error: KeelError) -> EdgeError:
    if isinstance(error, ledger_errors.SessionNotFound):
        return SessionNotVisible("no such session")
    if isinstance(error, ledger_errors.IdempotencyConflict):
        # The ledger's message quotes the requestId, which may be long.
        committed = error.metadata.get("seq")
        where = f" (seq {committed})" if committed else ""
        return Conflict(
            f"this requestId was used for another input{where}; use a new requestId for a new input"
        )
    if isinstance(error, ledger_errors.FactTooLarge | blob_errors.ChunkPastLength):
        return PayloadTooLarge(error.message)
    if isinstance(error, blob_errors.WrongBlobOffset | blob_errors.BlobIncomplete):
        return Conflict(error.message)
    if isinstance(
        error, ledger_errors.InvalidFact | ledger_errors.InvalidId | ledger_errors.InvalidCursor
    ):
        return BadRequest(error.message)
    if isinstance(error, ServiceUnavailable):
        return Unavailable("a Keel service is unavailable; retry shortly")
    if error.code.name in ("NOT_FOUND",):
        return NotFound(error.message)
    if error.code.name in ("INVALID_ARGUMENT", "OUT_OF_RANGE"):
        return BadRequest(error.message)
    if error.code.name in ("ALREADY_EXISTS", "FAILED_PRECONDITION", "ABORTED"):
        return Conflict(error.message)
    if error.code.name == "UNAUTHENTICATED":
        return Unauthorized(error.message)
    return Unavailable(_unavailable_message(error.message))


# A call that failed without a Keel error reads `<CODE>: <details>`, or the
# bare code when the details said nothing more: said for people.
_FAILED_CALLS = {
    "CANCELLED": "a call to a Keel service was cancelled before it answered "
    "(the service may be restarting or overloaded); retry shortly",
    "DEADLINE_EXCEEDED": "a Keel service did not answer in time; retry shortly",
    "RESOURCE_EXHAUSTED": "a Keel service is overloaded; retry shortly",
    "UNKNOWN": "a Keel service failed to answer (its log says why); retry shortly",
    "INTERNAL": "a Keel service failed to answer (its log says why); retry shortly",
}
_FAILED_CALL = re.compile(r"([A-Z_]+)(?:: .*)?", re.DOTALL)


def _unavailable_message(message: str) -> str:
    match = _FAILED_CALL.fullmatch(message)
    if match is None or match.group(1) not in grpc.StatusCode.__members__:
        return message
    code = match.group(1)
    return _FAILED_CALLS.get(code, f"a Keel service is unavailable ({code}); retry shortly")
