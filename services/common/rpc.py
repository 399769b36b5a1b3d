"""The one place a typed client turns a failed gRPC call into an exception.

Every typed client (ledger, kernel, runner, compaction) sends its calls
through `unary` or `streaming` with its service's error root; the status's
`ErrorInfo.reason` picks the subclass (`error_from_rpc`), so callers catch
`StaleEpoch` or `LeaseLost`, never a status code, and no client spells the
mapping itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import grpc

from services.common.errors import KeelError, error_from_rpc, reasons_of

R = TypeVar("R")
M = TypeVar("M")


_REASONS: dict[type[KeelError], dict[str, type[KeelError]]] = {}


def _reasons(root: type[KeelError]) -> dict[str, type[KeelError]]:
    # Computed at the first failure, once every subclass has been defined.
    known = _REASONS.get(root)
    if known is None:
        known = _REASONS[root] = reasons_of(root)
    return known


def as_error(err: grpc.aio.AioRpcError, root: type[KeelError]) -> KeelError:
    """The exception `root`'s service meant by this failed call."""
    return error_from_rpc(err, root, _reasons(root))


async def unary(call: Awaitable[R], root: type[KeelError]) -> R:
    """Awaits a unary call, raising the service's own exception on failure."""
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        raise as_error(err, root) from None


async def streaming(call: Any, root: type[KeelError]) -> AsyncIterator[Any]:
    """The messages of a server-streaming call; the call is cancelled when
    the consumer stops early, and a failure raises the service's exception."""
    try:
        async for message in call:
            yield message
    except grpc.aio.AioRpcError as err:
        raise as_error(err, root) from None
    finally:
        call.cancel()
