"""HTTP errors of the edge: every refusal is JSON `{error: {code, message}}`
with the right 4xx; a 500 is a bug::

    EdgeError
     ├── BadRequest          400  bad_request
     ├── Unauthorized        401  unauthorized
     ├── Forbidden           403  forbidden
     ├── NotFound            404  not_found
     ├── Conflict            409  conflict  (request id reuse, wrong blob offset)
     ├── PayloadTooLarge     413  payload_too_large
     └── Unavailable         503  unavailable
"""

from __future__ import annotations

from typing import ClassVar

from starlette.responses import JSONResponse

from services.common.errors import KeelError, ServiceUnavailable
from services.ledger import errors as ledger_errors


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


def from_service_error(error: KeelError) -> EdgeError:
    """A service's refusal, as the HTTP error a client should see."""
    if isinstance(error, ledger_errors.SessionNotFound):
        return NotFound("no such session")
    if isinstance(error, ledger_errors.IdempotencyConflict):
        return Conflict(f"{error.message}; use a new requestId for a new input")
    if isinstance(error, ledger_errors.FactTooLarge):
        return PayloadTooLarge(error.message)
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
