"""Stopping the edge of a test stack and starting a new one on the same ports.

A client that reconnects by itself must find the new edge where the old one
was: the HTTP and gRPC ports are kept, the ledger, kernel and runners behind
them carry on. The new server replaces `stack.edge`, so the fixture's
teardown stops it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from edge.server import EdgeServer

if TYPE_CHECKING:
    from tests.support.edge_stack import Stack


def grpc_port_of(edge: EdgeServer) -> int:
    address = edge.grpc_address
    assert address is not None, "this edge serves no gRPC API"
    return int(address.rsplit(":", 1)[1])


async def stop_edge(stack: Stack) -> int:
    """Stops the stack's edge (its streams get `drain` first); returns its gRPC port."""
    port = grpc_port_of(stack.edge)
    await stack.edge.stop()
    return port


async def start_edge(stack: Stack, grpc_port: int) -> EdgeServer:
    """A new edge on the old one's HTTP port and on `grpc_port`, as `stack.edge`."""
    old = stack.edge
    config = replace(old.config, grpc_port=grpc_port)
    stack.edge = await EdgeServer(old.settings, config, old.host, old.port).start()
    return stack.edge


async def restart_edge(stack: Stack, grpc_port: int | None = None) -> EdgeServer:
    """Stops the edge and starts it again on the same ports (`grpc_port`:
    another gRPC port, e.g. 0 to serve gRPC where the old one did not)."""
    port = grpc_port if grpc_port is not None else grpc_port_of(stack.edge)
    await stack.edge.stop()
    return await start_edge(stack, port)
