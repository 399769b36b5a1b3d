"""Errors of the runner service::

RunnerError
 ├── SessionNotOwned    NOT_FOUND         SESSION_NOT_OWNED
 ├── InvalidDrain       INVALID_ARGUMENT  INVALID_DRAIN
 └── Draining           UNAVAILABLE       DRAINING
"""

from __future__ import annotations

import grpc

from services.common.errors import KeelError


class RunnerError(KeelError):
    code = grpc.StatusCode.UNKNOWN
    reason = "RUNNER_ERROR"


class SessionNotOwned(RunnerError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "SESSION_NOT_OWNED"


class InvalidDrain(RunnerError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_DRAIN"


class Draining(RunnerError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "DRAINING"
