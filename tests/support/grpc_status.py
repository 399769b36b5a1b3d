"""What a gRPC refusal says beyond its code: the RetryInfo a Keel server
attaches when the caller should come back later."""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

_DETAILS_KEY = "grpc-status-details-bin"


def retry_delay_ms(err: grpc.aio.AioRpcError) -> int | None:
    """The RetryInfo delay of a failed call, in ms (None: no RetryInfo)."""
    metadata: Any = err.trailing_metadata() or ()
    for key, value in metadata:
        if key != _DETAILS_KEY or not isinstance(value, bytes):
            continue
        for detail in status_pb2.Status.FromString(value).details:
            retry = error_details_pb2.RetryInfo()
            if detail.Is(retry.DESCRIPTOR) and detail.Unpack(retry):
                delay_ms: int = retry.retry_delay.ToMilliseconds()
                return delay_ms
    return None
