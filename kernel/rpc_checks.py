"""The checks the kernel's RPCs apply to their requests' fields.

Every request is validated before it reaches a store and turned into a
clear INVALID_ARGUMENT naming the field. The checks are shared by the
servicer's groups of calls (kernel.servicer for runtimes and leases,
kernel.tenancy_rpcs for tenants, keys and loadouts), so they live apart
from both.
"""

from __future__ import annotations

from typing import Any

import grpc

from kernel.domain import check_id
from kernel.errors import InvalidArgument

Context = grpc.aio.ServicerContext[Any, Any]

# The longest free text a request may carry unless a field says otherwise.
MAX_TEXT = 4096


def positive_epoch(value: int) -> int:
    if value <= 0:
        raise InvalidArgument(f"epoch must be positive, got {value}", field="epoch")
    return value


def non_negative(value: int, what: str) -> int:
    if value < 0:
        raise InvalidArgument(f"{what} must be >= 0, got {value}", field=what)
    return value


def bounded_text(value: str, what: str, limit: int = MAX_TEXT) -> str:
    if len(value) > limit:
        raise InvalidArgument(f"{what} must be at most {limit} characters", field=what)
    return value


def optional_id(value: str, what: str) -> str:
    return check_id(value, what) if value else ""
