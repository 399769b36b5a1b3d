"""The kernel through gRPC: a real server on loopback, the typed client."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from keel.kernel.v1 import kernel_pb2 as pb
from keel.kernel.v1 import kernel_pb2_grpc as pb_grpc
from kernel import (
    DEFAULT_LOADOUT,
    ApiKeyGrant,
    EpochSuperseded,
    InvalidApiKey,
    InvalidArgument,
    KernelClient,
    KernelServer,
    Lease,
    LeaseLost,
    UnknownRuntime,
    UnknownSession,
    UnknownTenant,
)
from kernel.domain import FailureKind
from services.common.config import Settings
from services.common.errors import error_info
from services.common.serving import open_channel
from tests.support.kernel_stores import FAST
from tests.support.polling import eventually

# A safety net for awaiting something that must happen; never a measurement.
DEADLINE_S = 20.0


async def test_a_session_round_trip(client: KernelClient) -> None:
    assert await client.register_runtime("r1", "127.0.0.1:9", pid=7, version="v1") == 600_000
    await client.enqueue("s1", "t1", input_seq=2)
    info = await client.get_lease("s1")
    assert info.lease is None and info.queued and not info.parked
    lease = await client.claim("r1")
    assert lease is not None
    assert (lease.session_id, lease.tenant_id, lease.runtime_id, lease.epoch) == (
        "s1",
        "t1",
        "r1",
        1,
    )
    assert not lease.reclaimed and lease.failures == 0 and len(lease.attempt_id) == 32
    assert await client.renew("s1", 1, "r1") >= lease.expires_at_ms
    held = await client.get_lease("s1")
    assert held.lease is not None and held.lease.epoch == 1
    [runtime] = await client.list_runtimes()
    assert runtime.session_ids == ("s1",) and runtime.version == "v1" and runtime.pid == 7
    assert runtime.session_tenant_ids == ("t1",)
    result = await client.finish("s1", 1, "r1", read_through=2)
    assert not result.requeued and not result.parked
    assert await client.claim("r1", wait_ms=10) is None


async def test_enqueue_wakes_a_waiting_claim(evented: KernelServer) -> None:
    async with KernelClient(evented.target, evented.settings) as client:
        await client.register_runtime("r1")
        waiting = asyncio.create_task(client.claim("r1", wait_ms=300_000))
        await client.enqueue("s1", "t1", 1)
        lease = await asyncio.wait_for(waiting, DEADLINE_S)
        assert lease is not None and lease.session_id == "s1"


async def test_release_wakes_a_waiting_claim(evented: KernelServer) -> None:
    async with KernelClient(evented.target, evented.settings) as client:
        await client.register_runtime("r1")
        await client.register_runtime("r2")
        await client.enqueue("s1", "t1", 1)
        first = await client.claim("r1")
        assert first is not None
        waiting = asyncio.create_task(client.claim("r2", wait_ms=300_000))
        await client.release("s1", first.epoch, "r1")
        second = await asyncio.wait_for(waiting, DEADLINE_S)
        assert second is not None and second.epoch == 2 and not second.reclaimed


async def test_undraining_wakes_a_waiting_claim(evented: KernelServer) -> None:
    async with KernelClient(evented.target, evented.settings) as client:
        await client.register_runtime("r1")
        await client.set_drain("r1", "handoff")
        await client.enqueue("s1", "t1", 1)
        assert await client.claim("r1", wait_ms=20) is None
        [runtime] = await client.list_runtimes()
        assert runtime.drain_mode == "handoff"
        waiting = asyncio.create_task(client.claim("r1", wait_ms=300_000))
        await client.set_drain("r1", "none")
        lease = await asyncio.wait_for(waiting, DEADLINE_S)
        assert lease is not None


async def test_a_closed_attachment_hands_its_leases_over_at_once(evented: KernelServer) -> None:
    async with (
        KernelClient(evented.target, evented.settings) as owner,
        KernelClient(evented.target, evented.settings) as successor,
    ):
        await owner.register_runtime("owner")
        await successor.register_runtime("successor")
        await owner.enqueue("s1", "t1", 1)
        attachment = owner.attach("owner")
        await attachment.wait_connected()
        lease = await owner.claim("owner")
        assert lease is not None
        runtimes = {r.runtime_id: r for r in await owner.list_runtimes()}
        assert runtimes["owner"].attached and not runtimes["successor"].attached
        waiting = asyncio.create_task(successor.claim("successor", wait_ms=300_000))
        await attachment.close()
        assert attachment.closed
        taken = await asyncio.wait_for(waiting, DEADLINE_S)
        assert taken is not None and taken.reclaimed and taken.epoch == 2
        with pytest.raises(EpochSuperseded):
            await owner.renew("s1", lease.epoch, "owner")
        assert evented.metrics.totals()["expirations_disconnect"] == 1
        assert "expirations_ttl" not in evented.metrics.totals()
        await eventually(
            lambda: _attached(owner, "owner", False), what="the registry shows it detached"
        )


async def test_the_end_of_the_rpc_hands_leases_over_even_if_its_stream_lingers(
    evented: KernelServer,
) -> None:
    """gRPC may drop an Attach response generator suspended at a `yield`
    (the peer went away while a heartbeat was being sent), leaving it to the
    garbage collector; the leases then waited for their TTL. The RPC's own
    end is what counts: here the stream stays suspended, unclosed, and the
    end signalled for the RPC alone hands the lease over at once."""
    attachments = evented.attachments
    assert attachments is not None
    async with (
        KernelClient(evented.target, evented.settings) as owner,
        KernelClient(evented.target, evented.settings) as successor,
    ):
        await owner.register_runtime("owner")
        await successor.register_runtime("successor")
        await owner.enqueue("s1", "t1", 1)
        ends: list[Callable[[], None]] = []
        stream = attachments.stream("owner", ends.append)
        await anext(stream)  # attached; the generator now waits at its yield
        lease = await owner.claim("owner")
        assert lease is not None
        waiting = asyncio.create_task(successor.claim("successor", wait_ms=300_000))
        [end] = ends
        end()
        end()  # the generator's own end, later, must not count twice
        taken = await asyncio.wait_for(waiting, DEADLINE_S)
        assert taken is not None and taken.reclaimed and taken.epoch == 2
        assert evented.metrics.totals()["expirations_disconnect"] == 1
        # The stream was left suspended all along; closing it now ends nothing twice.
        await stream.aclose()
        assert evented.metrics.totals()["expirations_disconnect"] == 1


async def _attached(client: KernelClient, runtime_id: str, expected: bool) -> bool:
    runtimes = {r.runtime_id: r for r in await client.list_runtimes()}
    return runtimes[runtime_id].attached == expected


async def test_a_kernel_restart_expires_nothing(long_ttl: Settings) -> None:
    server = await KernelServer(long_ttl, config=FAST).start()
    async with KernelClient(server.target, server.settings) as client:
        await client.register_runtime("r1")
        await client.enqueue("s1", "t1", 1)
        attachment = client.attach("r1")
        await attachment.wait_connected()
        lease = await client.claim("r1")
        assert lease is not None
        await server.stop()
        assert not attachment.closed, "the runtime keeps trying to re-attach"
    restarted = await KernelServer(long_ttl, config=FAST).start()
    try:
        async with KernelClient(restarted.target, restarted.settings) as client:
            info = await client.get_lease("s1")
            assert info.lease is not None and info.lease.epoch == lease.epoch
            assert await client.renew("s1", lease.epoch, "r1") > 0
    finally:
        await restarted.stop()


async def test_ttl_expiry_through_the_service_is_a_reclaim(settings: Settings) -> None:
    short = settings.with_overrides(lease_ms=100)
    server = await KernelServer(short, config=FAST).start()
    try:
        async with KernelClient(server.target, server.settings) as client:
            await client.register_runtime("r1")
            await client.register_runtime("r2")
            await client.enqueue("s1", "t1", 1)
            first = await client.claim("r1")
            assert first is not None
            second = await client.claim("r2", wait_ms=60_000)
            assert second is not None and second.reclaimed and second.epoch == 2
            with pytest.raises(EpochSuperseded):
                await client.renew("s1", first.epoch, "r1")
    finally:
        await server.stop()


async def test_failed_attempts_back_off_then_park_until_unparked(client: KernelClient) -> None:
    await client.register_runtime("r1")
    await client.enqueue("s1", "t1", 1)
    for attempt in range(FAST.max_attempts):
        lease = await client.claim("r1", wait_ms=30_000)
        assert lease is not None and lease.failures == attempt
        result = await client.finish("s1", lease.epoch, "r1", 1, failed=True, error="boom")
        last = attempt == FAST.max_attempts - 1
        assert result.parked == last and result.requeued == (not last)
        if not last:
            assert result.not_before_ms > 0
    info = await client.get_lease("s1")
    assert info.parked and info.queued
    assert await client.claim("r1", wait_ms=30) is None
    await client.enqueue("s1", "t1", 2, unpark=True)
    lease = await client.claim("r1", wait_ms=30_000)
    assert lease is not None and lease.failures == 0


async def test_a_failures_kind_and_retry_after_travel_to_the_kernel(client: KernelClient) -> None:
    await client.register_runtime("r1")
    await client.enqueue("s1", "t1", 1)
    lease = await client.claim("r1", wait_ms=30_000)
    assert lease is not None
    result = await client.finish(
        "s1",
        lease.epoch,
        "r1",
        1,
        failed=True,
        error="429",
        kind=FailureKind.RATE_LIMITED,
        retry_after_ms=60_000,
    )
    assert result.requeued and not result.parked
    info = await client.get_lease("s1")
    # Not a failure; the next attempt waits for the provider's minute.
    assert (info.failures, info.rate_limits, info.last_error) == (0, 1, "429")
    assert info.not_before_ms == result.not_before_ms
    assert await client.claim("r1", wait_ms=30) is None
    # A new input does not cut the provider's wait short.
    await client.enqueue("s1", "t1", 2, unpark=True)
    assert await client.claim("r1", wait_ms=30) is None

    await client.enqueue("s2", "t1", 1)
    lease = await client.claim("r1", wait_ms=30_000)
    assert lease is not None and lease.session_id == "s2"
    result = await client.finish(
        "s2", lease.epoch, "r1", 1, failed=True, error="401", kind=FailureKind.PERMANENT
    )
    assert result.parked and result.parked_reason.endswith(": 401")
    info = await client.get_lease("s2")
    assert info.parked and info.failures == 1 and info.last_error == result.parked_reason


async def test_admission_limits_follow_the_latest_loadout(client: KernelClient) -> None:
    await client.register_runtime("r1")
    assert await client.create_tenant("acme", "Acme")
    assert await client.put_loadout("acme", {"maxConcurrentRuns": 1}) == 1
    for n in range(3):
        await client.enqueue(f"s{n}", "acme", 1)
    assert await client.claim("r1") is not None
    assert await client.claim("r1", wait_ms=20) is None
    assert await client.put_loadout("acme", {"maxConcurrentRuns": 3}) == 2
    assert await client.claim("r1") is not None
    assert await client.claim("r1") is not None


async def test_tenants_keys_and_loadouts(client: KernelClient) -> None:
    assert await client.create_tenant("acme")
    assert not await client.create_tenant("acme")
    key, key_id = await client.create_api_key("acme")
    assert key and key_id
    assert await client.authenticate(key) == ApiKeyGrant("acme", admin=False, operator=False)
    assert await client.create_api_key("acme", "fixed-dev-key-0123456789abc", admin=True) == (
        "fixed-dev-key-0123456789abc",
        (await client.create_api_key("acme", "fixed-dev-key-0123456789abc", admin=True))[1],
    )
    assert await client.authenticate("fixed-dev-key-0123456789abc") == ApiKeyGrant(
        "acme", True, False
    )
    operator, _ = await client.create_api_key("acme", admin=True, operator=True)
    assert await client.authenticate(operator) == ApiKeyGrant("acme", True, operator=True)
    loadout = await client.get_loadout("acme")
    assert loadout.revision == 0 and loadout.document == DEFAULT_LOADOUT
    document = {"model": {"provider": "scripted", "name": "s2"}, "maxConcurrentRuns": 4}
    assert await client.put_loadout("acme", document) == 1
    assert (await client.get_loadout("acme")).document == document
    assert (await client.get_loadout("acme", 1)).revision == 1


async def test_runtime_audit(client: KernelClient) -> None:
    await client.register_runtime("old", "10.0.0.1:1", host="a", pid=1, loadout_revision=3)
    await client.register_runtime("new", "10.0.0.2:1", host="b", pid=2, role="runner")
    handoff_id = await client.record_handoff(
        "old", "new", loadout_revision=3, in_flight=2, session_id="s1", epoch=5
    )
    [handoff] = await client.list_handoffs()
    assert handoff.handoff_id == handoff_id
    assert (handoff.old_runtime_id, handoff.new_runtime_id, handoff.in_flight) == ("old", "new", 2)
    assert (handoff.loadout_revision, handoff.session_id, handoff.epoch) == (3, "s1", 5)
    runtimes = {r.runtime_id: r for r in await client.list_runtimes()}
    assert runtimes["old"].loadout_revision == 3 and runtimes["old"].host == "a"
    assert runtimes["new"].drain_mode == "none" and runtimes["new"].started_at_ms > 0


async def test_concurrent_claimers_never_share_a_session(
    pg_settings: Settings,
) -> None:
    server = await KernelServer(pg_settings.with_overrides(lease_ms=600_000), config=FAST).start()
    sessions = [f"s{n:03d}" for n in range(60)]
    claims: list[tuple[str, int]] = []
    problems: list[str] = []
    try:
        async with KernelClient(server.target, server.settings) as admin:
            await admin.create_tenant("t1")
            await admin.put_loadout("t1", {"maxConcurrentRuns": 100})
            for session in sessions:
                await admin.enqueue(session, "t1", 1)

        async def claimer(runtime_id: str, seed: int) -> None:
            rng = random.Random(seed)
            async with KernelClient(server.target, server.settings) as client:
                await client.register_runtime(runtime_id)
                while (lease := await client.claim(runtime_id, wait_ms=200)) is not None:
                    claims.append((lease.session_id, lease.epoch))
                    try:
                        await client.renew(lease.session_id, lease.epoch, runtime_id)
                    except (LeaseLost, EpochSuperseded) as error:
                        problems.append(f"{runtime_id} lost {lease.session_id}: {error}")
                    if lease.epoch < 3 and rng.random() < 0.5:
                        await client.release(lease.session_id, lease.epoch, runtime_id)
                    else:
                        await client.finish(lease.session_id, lease.epoch, runtime_id, 1)

        await asyncio.gather(*(claimer(f"r{n}", n) for n in range(8)))
    finally:
        await server.stop()
    assert not problems
    assert len(claims) == len(set(claims)), "one epoch of a session was issued twice"
    by_session: dict[str, list[int]] = {}
    for session, epoch in claims:
        by_session.setdefault(session, []).append(epoch)
    assert sorted(by_session) == sessions
    for epochs in by_session.values():
        assert sorted(epochs) == list(range(1, len(epochs) + 1))


# -- bad input: clear status codes, and the server keeps answering --


@pytest.fixture
async def stub(kernel: KernelServer) -> AsyncIterator[pb_grpc.KernelServiceAsyncStub]:
    channel = open_channel(kernel.target, kernel.settings)
    try:
        yield pb_grpc.KernelServiceStub(channel)
    finally:
        await channel.close(None)


BAD_REQUESTS = [
    ("Claim", pb.ClaimRequest(runtime_id="r1", wait_ms=-1), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    ("Claim", pb.ClaimRequest(runtime_id=""), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    ("Claim", pb.ClaimRequest(runtime_id="ghost"), "NOT_FOUND", "UNKNOWN_RUNTIME"),
    (
        "Renew",
        pb.RenewRequest(session_id="bad id", epoch=1, runtime_id="r1"),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
    ),
    (
        "Renew",
        pb.RenewRequest(session_id="s1", epoch=0, runtime_id="r1"),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
    ),
    (
        "Renew",
        pb.RenewRequest(session_id="nobody", epoch=1, runtime_id="r1"),
        "NOT_FOUND",
        "SESSION_NOT_FOUND",
    ),
    (
        "Release",
        pb.ReleaseRequest(session_id="queued", epoch=1, runtime_id="r1"),
        "FAILED_PRECONDITION",
        "LEASE_LOST",
    ),
    (
        "Finish",
        pb.FinishRequest(session_id="held", epoch=9, runtime_id="r1"),
        "FAILED_PRECONDITION",
        "STALE_EPOCH",
    ),
    (
        "Finish",
        pb.FinishRequest(session_id="held", epoch=1, runtime_id="r1", read_through=-1),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
    ),
    ("Enqueue", pb.EnqueueRequest(session_id="s1", tenant_id=""), "INVALID_ARGUMENT", None),
    (
        "Enqueue",
        pb.EnqueueRequest(session_id="s1", tenant_id="t1", input_seq=-3),
        "INVALID_ARGUMENT",
        None,
    ),
    ("SetDrain", pb.SetDrainRequest(runtime_id="r1"), "INVALID_ARGUMENT", None),
    (
        "SetDrain",
        pb.SetDrainRequest(runtime_id="ghost", mode=pb.DRAIN_MODE_HANDOFF),
        "NOT_FOUND",
        "UNKNOWN_RUNTIME",
    ),
    ("RecordHandoff", pb.RecordHandoffRequest(old_runtime_id=""), "INVALID_ARGUMENT", None),
    ("ListHandoffs", pb.ListHandoffsRequest(limit=-1), "INVALID_ARGUMENT", None),
    ("CreateTenant", pb.CreateTenantRequest(tenant_id="a/b"), "INVALID_ARGUMENT", None),
    ("CreateApiKey", pb.CreateApiKeyRequest(tenant_id="ghost"), "NOT_FOUND", "UNKNOWN_TENANT"),
    (
        "CreateApiKey",
        pb.CreateApiKeyRequest(tenant_id="acme", key="has space"),
        "INVALID_ARGUMENT",
        None,
    ),
    ("Authenticate", pb.AuthenticateRequest(key="nope"), "UNAUTHENTICATED", "INVALID_API_KEY"),
    ("Authenticate", pb.AuthenticateRequest(key=""), "UNAUTHENTICATED", "INVALID_API_KEY"),
    (
        "PutLoadout",
        pb.PutLoadoutRequest(tenant_id="ghost", document_json="{}"),
        "NOT_FOUND",
        "UNKNOWN_TENANT",
    ),
    (
        "PutLoadout",
        pb.PutLoadoutRequest(tenant_id="acme", document_json="{not json"),
        "INVALID_ARGUMENT",
        None,
    ),
    (
        "PutLoadout",
        pb.PutLoadoutRequest(tenant_id="acme", document_json="[1]"),
        "INVALID_ARGUMENT",
        None,
    ),
    (
        "PutLoadout",
        pb.PutLoadoutRequest(tenant_id="acme", document_json='{"maxConcurrentRuns": 0}'),
        "INVALID_ARGUMENT",
        None,
    ),
    ("GetLoadout", pb.GetLoadoutRequest(tenant_id="ghost"), "NOT_FOUND", "UNKNOWN_TENANT"),
    (
        "GetLoadout",
        pb.GetLoadoutRequest(tenant_id="acme", revision=5),
        "NOT_FOUND",
        "LOADOUT_NOT_FOUND",
    ),
    ("GetLease", pb.GetLeaseRequest(session_id=""), "INVALID_ARGUMENT", None),
]


async def test_bad_requests_get_clear_statuses_and_the_server_keeps_serving(
    client: KernelClient, stub: pb_grpc.KernelServiceAsyncStub
) -> None:
    await client.register_runtime("r1")
    await client.create_tenant("acme")
    await client.enqueue("held", "t2", 1)
    held = await client.claim("r1")
    assert held is not None and held.session_id == "held"
    await client.enqueue("queued", "t1", 1)
    for method, request, code, reason in BAD_REQUESTS:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await getattr(stub, method)(request)
        assert failure.value.code().name == code, (method, request)
        info = error_info(failure.value)
        assert info is not None, f"{method} carried no ErrorInfo"
        if reason is not None:
            assert info.reason == reason, (method, request)
    # Still serving, and still correct.
    await client.enqueue("after", "t1", 1)
    leases = [await client.claim("r1"), await client.claim("r1")]
    assert {lease.session_id for lease in leases if lease} == {"queued", "after"}


async def test_the_client_raises_the_kernels_own_errors(client: KernelClient) -> None:
    await client.register_runtime("r1")
    with pytest.raises(InvalidArgument):
        await client.claim("r1", wait_ms=-5)
    with pytest.raises(UnknownRuntime):
        await client.claim("ghost")
    with pytest.raises(UnknownSession):
        await client.renew("nobody", 1, "r1")
    with pytest.raises(UnknownTenant):
        await client.put_loadout("ghost", {})
    with pytest.raises(InvalidApiKey):
        await client.authenticate("nope")
    with pytest.raises(InvalidArgument):
        await client.set_drain("r1", "sideways")
    attachment = client.attach("ghost")
    with pytest.raises(UnknownRuntime):
        await attachment.wait_connected()
    assert attachment.closed and isinstance(attachment.error, UnknownRuntime)


async def test_a_forgotten_runtime_registers_again_and_attaches(
    kernel: KernelServer, client: KernelClient
) -> None:
    """The kernel forgets runtimes detached past the retention; one still
    alive (a long partition) registers again rather than losing its Attach."""
    registrations = 0

    async def register() -> None:
        nonlocal registrations
        registrations += 1
        await client.register_runtime("came-back")

    attachment = client.attach("came-back", reregister=register)  # never registered
    await attachment.wait_connected()
    assert registrations == 1 and not attachment.closed
    listed = {r.runtime_id: r for r in await client.list_runtimes()}
    assert listed["came-back"].attached
    await attachment.close()


async def test_a_lease_taken_for_a_caller_that_left_is_handed_back(
    kernel: KernelServer, client: KernelClient
) -> None:
    # The store claim ran in a worker thread while the caller's RPC was
    # cancelled; the servicer gets the finished claim and must release it.
    await client.register_runtime("r1")
    await client.enqueue("s1", "t1", 1)
    assert kernel.leases is not None and kernel.servicer is not None
    lease = await asyncio.to_thread(kernel.leases.claim, "r1")
    assert lease is not None
    abandoned: asyncio.Future[Lease | None] = asyncio.get_running_loop().create_future()
    abandoned.set_result(lease)
    kernel.servicer._hand_back(abandoned)
    await kernel.servicer.close()
    info = await client.get_lease("s1")
    assert info.lease is None and info.queued
    again = await client.claim("r1")
    assert again is not None and again.epoch == 2 and not again.reclaimed
