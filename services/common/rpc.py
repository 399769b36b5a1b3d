"""The one place a typed client turns a failed gRPC call into an exception.

Every typed client (ledger, kernel, runner, compaction) sends its calls
through `unary` or `streaming` with its service's error root; the status's
`ErrorInfo.reason` picks the subclass (`error_from_rpc`), so callers catch
`StaleEpoch` or `LeaseLost`, never a status code, and no client spells the
mapping itself.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from services.common.errors import (
    KeelError,
    ServiceUnavailable,
    error_from_rpc,
    error_info,
    error_of_reason,
    reasons_of,
)

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


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def refusal_as_error(
    code: int, reason: str, message: str, metadata: Mapping[str, str], root: type[KeelError]
) -> KeelError:
    """The exception a refusal carried in a stream's message means (a status
    code number, an ErrorInfo reason, ...): the very class the same refusal
    as a unary call's status would raise."""
    status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
    return error_of_reason(status, reason, message, metadata, root, _reasons(root))


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


async def stream_answers(call: Any, root: type[KeelError]) -> AsyncIterator[Any]:
    """The messages of a long-lived stream whose messages answer requests
    sent on it (the ledger's AppendStream). When the stream fails, raises
    what the requests it left unanswered should raise: a refusal of the
    whole stream (with an ErrorInfo, e.g. a wrong internal token) as the
    service's exception, the one a unary call would raise; anything else
    (the server died, the connection broke) as ServiceUnavailable, since
    each request's outcome is unknown and resending it may be safe."""
    try:
        async for message in call:
            yield message
    except grpc.aio.AioRpcError as err:
        if error_info(err) is not None:
            raise as_error(err, root) from None
        raise ServiceUnavailable(f"the stream failed: {err.code().name}: {err.details()}") from None


# A failed call of an idempotent method is retried on another replica (or on
# the same one once it is back), a few times within about two seconds: long
# enough to ride out one replica's death, short enough that a caller whose
# whole service is down sees UNAVAILABLE promptly instead of hanging.
# Targets that already name their resolver are passed through untouched.
_SCHEMES = ("ipv4:", "ipv6:", "dns:", "unix:", "unix-abstract:", "vsock:")
_RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


def balanced_target(target: str) -> str:
    """The gRPC target for `target`, which may list replicas separated by
    commas (`127.0.0.1:7101,127.0.0.1:7111`): such a list becomes one
    `ipv4:`/`ipv6:` target the channel spreads calls over (round robin),
    skipping a replica that is down. A single address is kept as it is.

    Raises ValueError for a list that names a host instead of an IP address
    (gRPC resolves a list of IP addresses only)."""
    if "," not in target or target.startswith(_SCHEMES):
        return target
    addresses = [a.strip() for a in target.split(",") if a.strip()]
    families = set()
    for address in addresses:
        host = address.rpartition(":")[0].strip("[]")
        try:
            families.add(ipaddress.ip_address(host).version)
        except ValueError:
            raise ValueError(
                f"replica list {target!r}: {address!r} is not an IP address and port"
            ) from None
    if len(families) != 1:
        raise ValueError(f"replica list {target!r} mixes IPv4 and IPv6 addresses")
    return f"ipv{families.pop()}:{','.join(addresses)}"


def replica_channel_options(
    service: str, idempotent_methods: Sequence[str]
) -> list[tuple[str, Any]]:
    """Channel options for a client of `service` (its full proto name):
    round-robin over every address of the target, and retries on
    UNAVAILABLE for the methods that are safe to send twice."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if idempotent_methods:
        config["methodConfig"] = [
            {
                "name": [{"service": service, "method": m} for m in idempotent_methods],
                "retryPolicy": _RETRY_POLICY,
            }
        ]
    return [("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 1)]
