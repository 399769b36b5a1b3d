"""A runner newer than its kernel: a kernel without LeaseStream (a rolling
upgrade that reached the runners first) answers UNIMPLEMENTED, and the
client sends each lease operation as the unary RPC it stands for."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kernel import EpochSuperseded, KernelClient, KernelServer
from kernel.servicer import KernelServicer
from services.common import hops
from services.common.config import Settings
from tests.support.kernel_stores import FAST


@pytest.fixture
async def older_kernel(
    long_ttl: Settings, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[KernelServer]:
    async def no_lease_stream(
        self: KernelServicer, requests: object, context: Any
    ) -> AsyncIterator[object]:
        # What gRPC answers for a method the server does not have.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield None  # pragma: no cover - makes this an async generator

    monkeypatch.setattr(KernelServicer, "LeaseStream", no_lease_stream)
    server = await KernelServer(long_ttl, config=FAST).start()
    yield server
    await server.stop()


async def test_lease_operations_fall_back_to_the_unary_rpcs(older_kernel: KernelServer) -> None:
    async with KernelClient(older_kernel.target, older_kernel.settings) as client:
        before = hops.snapshot()
        await client.register_runtime("r1")
        await client.enqueue("s1", "t1", 1)
        claim = await client.claim_with_loadout("r1")
        assert claim is not None
        # An older kernel sends no loadout: the runner asks for it.
        assert claim.loadout is None
        lease = claim.lease
        assert await client.renew("s1", lease.epoch, "r1") > 0
        await client.release("s1", lease.epoch, "r1")
        again = await client.claim("r1")
        assert again is not None and again.epoch == lease.epoch + 1
        with pytest.raises(EpochSuperseded):
            await client.finish("s1", lease.epoch, "r1", read_through=1)
        result = await client.finish("s1", again.epoch, "r1", read_through=1)
        assert not result.requeued and not result.parked
        spent = hops.snapshot().since(before).calls
        for method in ("Claim", "Renew", "Finish", "Release"):
            assert spent.get(f"keel.kernel.v1.KernelService/{method}", 0) >= 1, spent
