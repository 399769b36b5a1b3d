"""LeaseStream: claims, renewals, finishes and releases as messages of one
stream decide exactly what the unary RPCs decide, concurrently, and the
claim brings the loadout its attempt runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from keel.kernel.v1 import kernel_pb2 as pb
from keel.kernel.v1 import kernel_pb2_grpc as pb_grpc
from kernel import (
    DEFAULT_LOADOUT,
    EpochSuperseded,
    InvalidArgument,
    KernelClient,
    KernelServer,
    LeaseLost,
    UnknownRuntime,
    UnknownSession,
)
from kernel.lease_stream_server import LEASE_STREAM
from services.common import hops
from services.common.errors import error_info
from services.common.serving import open_channel
from tests.support.polling import eventually

# A safety net for awaiting what must happen; never a measurement.
DEADLINE_S = 20.0


class RawStream:
    """A LeaseStream driven by hand: requests in, answers by id."""

    def __init__(self, stub: pb_grpc.KernelServiceAsyncStub) -> None:
        self._outbox: asyncio.Queue[pb.LeaseStreamRequest | None] = asyncio.Queue()
        self._call = stub.LeaseStream(self._requests())
        self._next_id = 0

    async def _requests(self) -> AsyncIterator[pb.LeaseStreamRequest]:
        while (request := await self._outbox.get()) is not None:
            yield request

    def send(self, request: pb.LeaseStreamRequest) -> int:
        self._next_id += 1
        request.id = self._next_id
        self._outbox.put_nowait(request)
        return self._next_id

    async def answer(self) -> pb.LeaseStreamResponse:
        answer = await asyncio.wait_for(self._call.read(), DEADLINE_S)
        assert isinstance(answer, pb.LeaseStreamResponse), answer
        return answer

    async def ask(self, request: pb.LeaseStreamRequest) -> pb.LeaseStreamResponse:
        request_id = self.send(request)
        answer = await self.answer()
        assert answer.id == request_id
        return answer

    def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()


@pytest.fixture
async def channel(kernel: KernelServer) -> AsyncIterator[grpc.aio.Channel]:
    opened = open_channel(kernel.target, kernel.settings)
    try:
        yield opened
    finally:
        await opened.close(None)


# (unary method, the stream's oneof field, request) refused on the state
# set up below: a session "held" by r1 at epoch 2 (epoch 1 was released), a
# session "queued" that nobody holds, a session "finished".
REFUSALS = [
    ("Claim", "claim", pb.ClaimRequest(runtime_id="ghost")),
    ("Claim", "claim", pb.ClaimRequest(runtime_id="r1", wait_ms=-1)),
    ("Claim", "claim", pb.ClaimRequest(runtime_id="")),
    ("Claim", "claim", pb.ClaimRequest(runtime_id="r1", wait_ms=300_001)),
    ("Renew", "renew", pb.RenewRequest(session_id="held", epoch=1, runtime_id="r1")),
    ("Renew", "renew", pb.RenewRequest(session_id="held", epoch=3, runtime_id="r1")),
    ("Renew", "renew", pb.RenewRequest(session_id="held", epoch=2, runtime_id="r2")),
    ("Renew", "renew", pb.RenewRequest(session_id="held", epoch=0, runtime_id="r1")),
    ("Renew", "renew", pb.RenewRequest(session_id="nobody", epoch=1, runtime_id="r1")),
    ("Renew", "renew", pb.RenewRequest(session_id="finished", epoch=1, runtime_id="r1")),
    ("Finish", "finish", pb.FinishRequest(session_id="held", epoch=1, runtime_id="r1")),
    (
        "Finish",
        "finish",
        pb.FinishRequest(session_id="held", epoch=2, runtime_id="r1", read_through=-1),
    ),
    ("Finish", "finish", pb.FinishRequest(session_id="finished", epoch=1, runtime_id="r1")),
    ("Release", "release", pb.ReleaseRequest(session_id="queued", epoch=1, runtime_id="r1")),
    ("Release", "release", pb.ReleaseRequest(session_id="held", epoch=1, runtime_id="r1")),
    (
        "Release",
        "release",
        pb.ReleaseRequest(
            session_id="held", epoch=2, runtime_id="r1", handoff=pb.HandoffNote(in_flight=-1)
        ),
    ),
]


async def test_refusals_on_the_stream_say_what_the_rpcs_say(
    client: KernelClient, channel: grpc.aio.Channel
) -> None:
    await client.register_runtime("r1")
    await client.register_runtime("r2")
    await client.enqueue("held", "t1", 1)
    first = await client.claim("r1")
    assert first is not None and first.session_id == "held"
    await client.release("held", first.epoch, "r1")
    held = await client.claim("r1")
    assert held is not None and held.epoch == 2
    await client.enqueue("finished", "t1", 1)
    done = await client.claim("r1")
    assert done is not None and done.session_id == "finished"
    await client.finish("finished", done.epoch, "r1", read_through=1)
    await client.enqueue("queued", "t1", 1)

    stub = pb_grpc.KernelServiceStub(channel)
    stream = RawStream(stub)
    try:
        for method, field, request in REFUSALS:
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await getattr(stub, method)(request)
            info = error_info(failure.value)
            assert info is not None
            answer = await stream.ask(pb.LeaseStreamRequest(**{field: request}))
            assert answer.WhichOneof("outcome") == "error", (method, request)
            refusal = answer.error
            said = (refusal.code, refusal.reason, refusal.message, dict(refusal.metadata))
            assert said == (
                failure.value.code().value[0],
                info.reason,
                failure.value.details(),
                dict(info.metadata),
            ), (method, request)
    finally:
        stream.close()
    # Refusals changed nothing: the held lease is still r1's at epoch 2.
    info_after = await client.get_lease("held")
    assert info_after.lease is not None and info_after.lease.epoch == 2
    assert (await client.get_lease("queued")).queued


async def test_the_client_raises_the_same_exceptions_over_the_stream(
    client: KernelClient,
) -> None:
    before = hops.snapshot()
    await client.register_runtime("r1")
    await client.enqueue("s1", "t1", 1)
    lease = await client.claim("r1")
    assert lease is not None
    await client.release("s1", lease.epoch, "r1")
    again = await client.claim("r1")
    assert again is not None and again.epoch == lease.epoch + 1
    with pytest.raises(EpochSuperseded) as stale:
        await client.renew("s1", lease.epoch, "r1")
    assert stale.value.metadata.get("current_epoch") == str(again.epoch)
    with pytest.raises(EpochSuperseded):
        await client.finish("s1", lease.epoch, "r1", read_through=1)
    with pytest.raises(UnknownRuntime):
        await client.claim("ghost")
    with pytest.raises(InvalidArgument):
        await client.claim("r1", wait_ms=-5)
    with pytest.raises(UnknownSession):
        await client.renew("nobody", 1, "r1")
    result = await client.finish("s1", again.epoch, "r1", read_through=1)
    assert not result.requeued and not result.parked
    with pytest.raises(LeaseLost):
        await client.release("s1", again.epoch, "r1")
    spent = hops.snapshot().since(before).calls
    # Every lease operation was a message of one stream, none a call.
    for method in ("Claim", "Renew", "Finish", "Release"):
        assert f"keel.kernel.v1.KernelService/{method}" not in spent, spent
    assert spent[LEASE_STREAM] >= 10


async def test_a_long_polling_claim_does_not_hold_up_a_renewal_behind_it(
    evented: KernelServer,
) -> None:
    async with KernelClient(evented.target, evented.settings) as client:
        await client.register_runtime("r1")
        await client.enqueue("s1", "t1", 1)
        held = await client.claim("r1")
        assert held is not None
        waiting = asyncio.create_task(client.claim("r1", wait_ms=300_000))
        # Both on the one stream, the renewal sent after the claim.
        expires = await asyncio.wait_for(client.renew("s1", held.epoch, "r1"), DEADLINE_S)
        assert expires >= held.expires_at_ms
        result = await asyncio.wait_for(
            client.finish("s1", held.epoch, "r1", read_through=1), DEADLINE_S
        )
        assert not result.requeued
        assert not waiting.done()
        await client.enqueue("s2", "t1", 1)
        woken = await asyncio.wait_for(waiting, DEADLINE_S)
        assert woken is not None and woken.session_id == "s2"


async def test_a_claim_whose_caller_stopped_waiting_takes_nothing(
    evented: KernelServer,
) -> None:
    async with KernelClient(evented.target, evented.settings) as client:
        await client.register_runtime("r1")
        read = _messages_read()
        waiting = asyncio.create_task(client.claim("r1", wait_ms=300_000))

        async def claim_read() -> bool:
            return _messages_read() > read

        await eventually(claim_read, what="the kernel to read the claim")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await client.enqueue("s1", "t1", 1)

        # Withdrawn before the enqueue, or granted just before the
        # withdrawal arrived and then released by the client: either way
        # nobody holds the session and it is runnable.
        async def free_and_queued() -> bool:
            info = await client.get_lease("s1")
            return info.lease is None and info.queued

        await eventually(free_and_queued, what="s1 to be free and queued")
        other = await client.claim("r1")
        assert other is not None and other.session_id == "s1" and not other.reclaimed


def _messages_read() -> int:
    # The kernel runs in this process: its count of stream messages handled
    # (and of streams opened, under the same name).
    return hops.snapshot().calls.get(LEASE_STREAM, 0)


async def test_a_claim_brings_its_tenants_latest_loadout(
    client: KernelClient, channel: grpc.aio.Channel
) -> None:
    await client.register_runtime("r1")
    await client.create_tenant("acme")
    first = await client.put_loadout("acme", {"systemPrompt": "One."})
    for n in range(4):
        await client.enqueue(f"s{n}", "acme", 1)
    await client.enqueue("stranger", "nobody", 1)

    stream = RawStream(pb_grpc.KernelServiceStub(channel))
    claim = pb.LeaseStreamRequest(claim=pb.ClaimRequest(runtime_id="r1", with_loadout=True))
    try:
        sent = (await stream.ask(claim)).claim
        assert sent.loadout.revision == first
        assert '"systemPrompt": "One."' in sent.loadout.document_json
        # The same revision again on this stream: the document stays home.
        again = (await stream.ask(claim)).claim
        assert again.lease.session_id != sent.lease.session_id
        assert again.loadout.revision == first and again.loadout.document_json == ""
        second = await client.put_loadout("acme", {"systemPrompt": "Two."})
        changed = (await stream.ask(claim)).claim
        assert changed.loadout.revision == second
        assert '"systemPrompt": "Two."' in changed.loadout.document_json
    finally:
        stream.close()

    # Through the client (a stream of its own): the documents themselves.
    got = await client.claim_with_loadout("r1")
    assert got is not None and got.loadout is not None
    assert (got.loadout.revision, got.loadout.document["systemPrompt"]) == (second, "Two.")
    # A tenant the kernel does not know: no loadout, GetLoadout says why.
    unknown = await client.claim_with_loadout("r1")
    assert unknown is not None and unknown.lease.session_id == "stranger"
    assert unknown.loadout is None


async def test_a_claim_of_a_tenant_without_a_stored_loadout_brings_the_default(
    client: KernelClient,
) -> None:
    await client.register_runtime("r1")
    await client.create_tenant("plain")
    await client.enqueue("p1", "plain", 1)
    await client.enqueue("p2", "plain", 1)
    for _ in range(2):  # the second from what the stream sent first
        claimed = await client.claim_with_loadout("r1")
        assert claimed is not None and claimed.loadout is not None
        assert claimed.loadout.revision == 0
        assert claimed.loadout.document == DEFAULT_LOADOUT
