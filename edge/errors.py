"""HTTP errors of the edge: every refusal is JSON `{error: {code, message}}`
with the right 4xx; a 500 is a bug::

    EdgeError
     ├── BadRequest          400  bad_request
     ├── Unauthorized        401  unauthorized
     ├── Forbidden           403  forbidden
     ├── NotFound            404  not_found
     ├── MethodNotAllowed    405  method_not_allowed
     ├── Conflict            409  conflict  (request id reuse, wrong blob offset)
     ├── PayloadTooLarge     413  payload_too_large
     └── Unavailable         503  unavailable

Service errors (`KeelError`) reach clients through `from_service_error`; the
app registers both roots as exception handlers, so routes only raise.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services import blobs as blob_errors
from services.common.errors import KeelError, ServiceUnavailable
from services.ledger import errors as ledger_errors

log = logging.getLogger("keel.edge")

# A refusal names what it refused, but never hands a long client value back:
# error messages end up in logs and UIs.
MAX_ECHO_CHARS = 64


class EdgeError(Exception):
    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def response(self) -> JSONResponse:
        return error_response(self.status, self.code, self.message)


class BadRequest(EdgeError):
    status = 400
    code = "bad_request"


class Unauthorized(EdgeError):
    status = 401
    code = "unauthorized"


class Forbidden(EdgeError):
    status = 403
    code = "forbidden"


class NotFound(EdgeError):
    status = 404
    code = "not_found"


class MethodNotAllowed(EdgeError):
    status = 405
    code = "method_not_allowed"


class Conflict(EdgeError):
    status = 409
    code = "conflict"


class PayloadTooLarge(EdgeError):
    status = 413
    code = "payload_too_large"


class Unavailable(EdgeError):
    status = 503
    code = "unavailable"


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


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
        log.warning("%s %s: %s (%s)", request.method, request.url.path, error.message, error.reason)
    return mapped.response()


def from_service_error(error: KeelError) -> EdgeError:
    """A service's refusal, as the HTTP error a client should see."""
    if isinstance(error, ledger_errors.SessionNotFound):
        return NotFound("no such session")
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
    return Unavailable(error.message)
