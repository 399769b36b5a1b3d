"""A revoked key gets 401 at once on every edge, not when caches expire.

Each edge caches a valid key's caller for AUTH_CACHE_S (30 s) so requests do
not each ask the kernel. The edges follow the kernel's WatchRevocations and
drop a revoked key from that cache as soon as the kernel reports it. The
deadline these tests poll under is far below AUTH_CACHE_S: a 401 before it
can only come from the watch, never from the cache running out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from edge.auth import AUTH_CACHE_S
from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from kernel import KernelClient, KernelServer
from services.common.errors import ServiceUnavailable
from tests.support.edge_stack import Stack
from tests.support.polling import eventually

# A correctness bound (well inside the cache's lifetime), not a speed target.
REVOKED_WITHIN_S = 5.0
assert REVOKED_WITHIN_S < AUTH_CACHE_S / 3


@pytest.fixture
async def second_edge(stack: Stack) -> AsyncIterator[EdgeServer]:
    """Another edge process's worth of gateway on the same ledger and kernel."""
    cluster = stack.cluster
    edge = await EdgeServer(
        cluster.settings,
        EdgeConfig(cluster.ledger_server.target, cluster.kernel_server.target),
    ).start()
    yield edge
    await edge.stop()


async def status_with(url: str, key: str) -> int:
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=10.0
    ) as http:
        return (await http.get("/v1/sessions")).status_code


async def refused_within(url: str, key: str, deadline_s: float) -> None:
    """Polls until the edge answers 401 for `key`; fails at the deadline."""

    async def refused() -> bool:
        status = await status_with(url, key)
        assert status in (200, 401), status
        return status == 401

    await eventually(refused, f"{url} to refuse the revoked key", deadline_s)


async def revoke_once_reachable(kernel: KernelClient, key_id: str, deadline_s: float) -> None:
    """Revokes through a client whose channel may still be backing off from
    the kernel's absence (gRPC reconnects on its own schedule)."""
    # Not tests.support.polling: only ServiceUnavailable is retried, and any
    # other error must surface at once.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        try:
            await kernel.revoke_api_key(key_id)
            return
        except ServiceUnavailable:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_a_revoked_key_is_refused_by_every_edge_that_cached_it(
    stack: Stack, second_edge: EdgeServer
) -> None:
    kernel = stack.cluster.kernel
    key, key_id = await kernel.create_api_key("default", admin=True)
    kept, _ = await kernel.create_api_key("default")
    edges = [stack.url, second_edge.url]
    for url in edges:
        # Both edges now hold the key in their caches.
        assert await status_with(url, key) == 200
        assert await status_with(url, kept) == 200

    assert await kernel.revoke_api_key(key_id)
    await asyncio.gather(*(refused_within(url, key, REVOKED_WITHIN_S) for url in edges))
    # Only that key was dropped: another of the tenant's keys still works.
    for url in edges:
        assert await status_with(url, kept) == 200


async def test_edges_follow_revocations_across_a_kernel_restart(
    stack: Stack, second_edge: EdgeServer
) -> None:
    """The kernel goes away and comes back on the same address; the edges'
    watches reconnect and still drop a key revoked after the restart (in the
    backlog after the last revocation they saw, or live)."""
    cluster = stack.cluster
    kernel = cluster.kernel
    first_key, first_id = await kernel.create_api_key("default")
    key, key_id = await kernel.create_api_key("default")
    edges = [stack.url, second_edge.url]
    for url in edges:
        assert await status_with(url, first_key) == 200
    assert await kernel.revoke_api_key(first_id)
    await asyncio.gather(*(refused_within(url, first_key, REVOKED_WITHIN_S) for url in edges))
    loop = asyncio.get_running_loop()
    cached_at = loop.time()
    for url in edges:
        assert await status_with(url, key) == 200

    old = cluster.kernel_server
    address = old.target
    await old.stop()
    cluster.kernel_server = await KernelServer(
        cluster.settings,
        address,
        ledger_target=cluster.ledger_server.target,
        config=old.config,
    ).start()
    await revoke_once_reachable(kernel, key_id, deadline_s=REVOKED_WITHIN_S)
    # The restart and the edges' reconnection backoff count against this
    # bound too; it still ends long before the cached entries could expire.
    remaining = cached_at + AUTH_CACHE_S / 2 - loop.time()
    await asyncio.gather(*(refused_within(url, key, remaining) for url in edges))
