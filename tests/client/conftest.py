"""The client library's tests run against the edge test stack (tests/edge)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from keel_client import AsyncKeelClient
from tests.edge.conftest import runner, stack
from tests.support.edge_restart import restart_edge
from tests.support.edge_stack import ADMIN_KEY, Stack

__all__ = ["runner", "stack"]


@pytest.fixture
async def grpc_address(stack: Stack) -> AsyncIterator[str]:
    """The gRPC address of the stack's edge (serving it if the stack does not).

    A test may replace the edge (tests/support/edge_restart.py); the stack's
    teardown stops only the edge it started, so the replacement is stopped here.
    """
    started = stack.edge
    if stack.edge.grpc_address is None:
        await restart_edge(stack, grpc_port=0)
    address = stack.edge.grpc_address
    assert address is not None
    try:
        yield address
    finally:
        if stack.edge is not started:
            await stack.edge.stop()


@pytest.fixture
async def keel(grpc_address: str) -> AsyncIterator[AsyncKeelClient]:
    """A client of the stack's edge with the admin (and operator) key of "default"."""
    async with AsyncKeelClient(grpc_address, ADMIN_KEY) as client:
        yield client
