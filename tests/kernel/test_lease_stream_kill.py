"""A kernel process SIGKILLed under an open LeaseStream: what was in flight
fails retryably, and the client's next operation opens a new stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kernel import KernelClient
from services.common.config import Settings
from services.common.errors import ServiceUnavailable
from services.ledger import LedgerServer
from tests.support.databases import settings_env
from tests.support.kernel_stores import LONG_TTL_MS
from tests.support.polling import eventually
from tests.support.ports import free_port
from tests.support.processes import ChildProcess

pytestmark = pytest.mark.slow

# Only a safety net: the claim below waits far longer than any deadline here.
DEADLINE_S = 60.0


def _kernel_process(settings: Settings, address: str, ledger_target: str) -> ChildProcess:
    return ChildProcess.python(
        "-m",
        "services.cli.main",
        "kernel",
        "--address",
        address,
        "--ledger",
        ledger_target,
        env=settings_env(settings),
    )


@pytest.fixture
def lease_settings(pg_settings: Settings) -> Iterator[Settings]:
    # Only this test's own operations end a lease, never its TTL.
    yield pg_settings.with_overrides(lease_ms=LONG_TTL_MS)


async def test_a_killed_kernel_fails_what_was_in_flight_and_the_client_reconnects(
    lease_settings: Settings,
) -> None:
    settings = lease_settings
    ledger = await LedgerServer(settings).start()
    address = f"127.0.0.1:{free_port()}"
    kernel = _kernel_process(settings, address, ledger.target)
    replacement: ChildProcess | None = None
    try:
        await kernel.line(lambda line: "kernel listening on" in line, DEADLINE_S)
        async with KernelClient(address, settings) as client:
            await client.register_runtime("r1")
            await client.enqueue("s1", "t1", 1)
            held = await client.claim("r1")
            assert held is not None
            waiting = asyncio.create_task(client.claim("r1", wait_ms=300_000))
            # Sent after the claim on the same stream: once it is answered,
            # the kernel is working on the claim.
            await client.renew("s1", held.epoch, "r1")
            assert not waiting.done()

            kernel.kill()
            with pytest.raises(ServiceUnavailable):
                await asyncio.wait_for(waiting, DEADLINE_S)

            replacement = _kernel_process(settings, address, ledger.target)
            await replacement.line(lambda line: "kernel listening on" in line, DEADLINE_S)

            # The next operation opens a new stream to the new process (the
            # channel may still be backing off its reconnection at first).
            async def renewed() -> int | None:
                try:
                    return await client.renew("s1", held.epoch, "r1")
                except ServiceUnavailable:
                    return None

            expires = await eventually(renewed, "the client to reach the new kernel", DEADLINE_S)
            assert expires >= held.expires_at_ms
            # The killed claim took nothing; the stream serves claims again.
            await client.enqueue("s2", "t1", 1)
            after = await client.claim("r1", wait_ms=10_000)
            assert after is not None and after.session_id == "s2" and after.epoch == 1
            result = await client.finish("s1", held.epoch, "r1", read_through=1)
            assert not result.requeued
    finally:
        kernel.kill()
        if replacement is not None:
            replacement.kill()
        await ledger.stop(grace=0)
