"""Sticky windows over real gRPC: a Finish on a LeaseStream keeps the
session, and its next input comes back down that stream as a wake with the
same epoch; every other way in (a unary Finish, a stream that ended, a
drain, a new loadout, a tenant with no free slot) ends the window, and the
next claim issues a new epoch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from keel.kernel.v1 import kernel_pb2 as pb
from keel.kernel.v1 import kernel_pb2_grpc as pb_grpc
from kernel import KernelClient, KernelServer, Lease
from kernel.domain import LeaseState
from kernel.servicer import MAX_WAKE_FACTS_BYTES
from kernel.store import LeaseStore
from services.common.serving import open_channel

WINDOW_MS = 600_000
DEADLINE_S = 20.0


@pytest.fixture
async def keeper(kernel: KernelServer) -> AsyncIterator[KernelClient]:
    """Runtime A's client: its own LeaseStream."""
    async with KernelClient(kernel.target, kernel.settings) as opened:
        await opened.register_runtime("A")
        await opened.create_tenant("t1")
        yield opened


@pytest.fixture
async def other(kernel: KernelServer) -> AsyncIterator[KernelClient]:
    async with KernelClient(kernel.target, kernel.settings) as opened:
        await opened.register_runtime("B")
        yield opened


def leases(kernel: KernelServer) -> LeaseStore:
    assert kernel.leases is not None
    return kernel.leases


def state_of(kernel: KernelServer, session_id: str) -> LeaseState:
    record = leases(kernel).record(session_id)
    assert record is not None
    return record.state


async def kept(keeper: KernelClient, session_id: str, tenant_id: str = "t1") -> Lease:
    """A's first turn of `session_id`, finished asking for a window."""
    await keeper.enqueue(session_id, tenant_id, 1)
    claim = await keeper.claim_with_loadout("A")
    assert claim is not None and claim.lease.session_id == session_id
    lease = claim.lease
    result = await keeper.finish(session_id, lease.epoch, "A", read_through=1, sticky_ms=WINDOW_MS)
    assert result.sticky_until_ms > 0 and not result.requeued
    return lease


async def test_an_input_in_the_window_wakes_the_keeper_with_the_same_epoch(
    kernel: KernelServer, keeper: KernelClient
) -> None:
    lease = await kept(keeper, "s1")
    assert state_of(kernel, "s1") is LeaseState.STICKY
    assert leases(kernel).slots("t1")[0] == 0, "a kept session holds no slot"

    await keeper.enqueue("s1", "t1", 2)
    woken = await asyncio.wait_for(keeper.next_wake(), DEADLINE_S)
    assert (woken.lease.session_id, woken.lease.epoch) == ("s1", lease.epoch)
    assert woken.lease.runtime_id == "A" and not woken.lease.reclaimed
    assert woken.loadout is not None, "the wake brings the loadout as a claim does"
    info = await keeper.get_lease("s1")
    assert info.lease is not None and info.lease.epoch == lease.epoch
    assert leases(kernel).slots("t1")[0] == 1, "the wake took a slot"
    # The woken turn settles like any other, and may keep the session again.
    again = await keeper.finish("s1", lease.epoch, "A", read_through=2, sticky_ms=WINDOW_MS)
    assert again.sticky_until_ms > 0
    assert leases(kernel).slots("t1")[0] == 0


async def test_a_finish_over_the_unary_rpc_keeps_nothing(
    kernel: KernelServer, keeper: KernelClient
) -> None:
    await keeper.enqueue("s1", "t1", 1)
    lease = await keeper.claim("A")
    assert lease is not None
    channel = open_channel(kernel.target, kernel.settings)
    try:
        reply = await pb_grpc.KernelServiceStub(channel).Finish(
            pb.FinishRequest(
                session_id="s1", epoch=lease.epoch, runtime_id="A", read_through=1, sticky_ms=1000
            )
        )
    finally:
        await channel.close(None)
    assert reply.sticky_until_ms == 0
    assert state_of(kernel, "s1") is LeaseState.FINISHED


async def test_an_input_after_the_keepers_stream_ended_is_claimed_with_a_new_epoch(
    kernel: KernelServer, keeper: KernelClient, other: KernelClient
) -> None:
    lease = await kept(keeper, "s1")
    await keeper.close()  # its LeaseStream ends: no wake can reach it
    await other.enqueue("s1", "t1", 2)
    assert state_of(kernel, "s1") is LeaseState.RELEASED
    claimed = await other.claim("B")
    assert claimed is not None and claimed.epoch == lease.epoch + 1


@pytest.mark.parametrize("ending", ["drain", "loadout"])
async def test_a_drain_or_a_new_loadout_ends_the_window(
    kernel: KernelServer, keeper: KernelClient, other: KernelClient, ending: str
) -> None:
    lease = await kept(keeper, "s1")
    if ending == "drain":
        await keeper.set_drain("A", "handoff")
    else:
        await other.put_loadout("t1", {"systemPrompt": "A new revision."})
    assert state_of(kernel, "s1") is LeaseState.RELEASED
    await other.enqueue("s1", "t1", 2)
    claimed = await other.claim("B")
    assert claimed is not None and claimed.epoch == lease.epoch + 1


async def test_a_tenant_with_no_free_slot_ends_the_window_instead_of_waking(
    kernel: KernelServer, keeper: KernelClient, other: KernelClient
) -> None:
    await other.put_loadout("t1", {"maxConcurrentRuns": 1})
    lease = await kept(keeper, "s1")
    await other.enqueue("s2", "t1", 1)
    busy = await other.claim("B")
    assert busy is not None and busy.session_id == "s2"

    await other.enqueue("s1", "t1", 2)
    assert state_of(kernel, "s1") is LeaseState.RELEASED
    assert leases(kernel).slots("t1")[0] == 1
    await other.finish("s2", busy.epoch, "B", read_through=1)
    claimed = await other.claim("B")
    assert claimed is not None and (claimed.session_id, claimed.epoch) == ("s1", lease.epoch + 1)


async def test_an_input_does_not_wake_its_keeper_ahead_of_sessions_waiting_for_a_slot(
    kernel: KernelServer, keeper: KernelClient, other: KernelClient
) -> None:
    """A wake skips the queue; with another session of the tenant queued it
    would take the slot that one waits for, every time an input comes. It
    queues behind it instead, and the slot goes in queue order."""
    await other.put_loadout("t1", {"maxConcurrentRuns": 1})
    lease = await kept(keeper, "s1")
    # Queued first. (Both may be queued within one millisecond: the queue
    # then goes by session id, and s0 sorts first.)
    await other.enqueue("s0", "t1", 1)

    await other.enqueue("s1", "t1", 2)
    assert state_of(kernel, "s1") is LeaseState.RELEASED
    assert leases(kernel).slots("t1")[0] == 0, "no slot was taken by a wake"
    first = await other.claim("B")
    assert first is not None and first.session_id == "s0"
    await other.finish("s0", first.epoch, "B", read_through=1)
    then = await other.claim("B")
    assert then is not None and (then.session_id, then.epoch) == ("s1", lease.epoch + 1)


async def test_a_finish_does_not_hold_the_lease_on_while_others_wait_for_a_slot(
    kernel: KernelServer, keeper: KernelClient, other: KernelClient
) -> None:
    """Held on turn after turn, a busy session would keep its slot for as
    long as its inputs come faster than its answers; with another session of
    the tenant waiting, the Finish re-queues it behind that one."""
    await other.put_loadout("t1", {"maxConcurrentRuns": 1})
    await keeper.enqueue("s1", "t1", 1)
    lease = await keeper.claim("A")
    assert lease is not None
    # Waits: the tenant's one slot is s1's. (Queued within the same
    # millisecond as s1's re-queueing, s0 still goes first by id.)
    await other.enqueue("s0", "t1", 1)
    await keeper.enqueue("s1", "t1", 2)

    finished = await keeper.finish("s1", lease.epoch, "A", read_through=1, sticky_ms=WINDOW_MS)
    assert finished.requeued and not finished.continued and finished.sticky_until_ms == 0
    first = await other.claim("B")
    assert first is not None and first.session_id == "s0"
    await other.finish("s0", first.epoch, "B", read_through=1)
    then = await keeper.claim("A")
    assert then is not None and (then.session_id, then.epoch) == ("s1", lease.epoch + 1)


async def test_sessions_queued_with_slots_to_spare_hold_back_no_wake_and_no_holding_on(
    kernel: KernelServer, keeper: KernelClient, other: KernelClient
) -> None:
    """Queued only until a claim reaches them, with a free slot each, other
    sessions lose nothing to a wake or to a lease held on."""
    await other.put_loadout("t1", {"maxConcurrentRuns": 3})
    lease = await kept(keeper, "s1")
    await other.enqueue("s2", "t1", 1)
    await other.enqueue("s1", "t1", 2)
    woken = await asyncio.wait_for(keeper.next_wake(), DEADLINE_S)
    assert (woken.lease.session_id, woken.lease.epoch) == ("s1", lease.epoch)
    await other.enqueue("s1", "t1", 3)
    held_on = await keeper.finish("s1", lease.epoch, "A", read_through=2, sticky_ms=WINDOW_MS)
    assert held_on.continued
    waiting = await other.claim("B")
    assert waiting is not None and waiting.session_id == "s2"


async def test_a_warm_turn_wakes_no_long_polling_claim(
    kernel: KernelServer, keeper: KernelClient, other: KernelClient
) -> None:
    """A wake and a Finish that keeps the session make nothing claimable:
    claims long-polling meanwhile are not woken to look for nothing. A Finish
    that gives back a slot another queued session waits for does wake them."""
    await other.put_loadout("t1", {"maxConcurrentRuns": 1})
    lease = await kept(keeper, "s1")
    quiet = kernel.waker.wakes
    await other.enqueue("s1", "t1", 2)
    await asyncio.wait_for(keeper.next_wake(), DEADLINE_S)
    kept_again = await keeper.finish("s1", lease.epoch, "A", read_through=2, sticky_ms=WINDOW_MS)
    assert kept_again.sticky_until_ms > 0
    assert kernel.waker.wakes == quiet, "a warm turn woke the waiting claims"

    await other.enqueue("s1", "t1", 3)
    await asyncio.wait_for(keeper.next_wake(), DEADLINE_S)
    woken_by_queue = kernel.waker.wakes
    await other.enqueue("s2", "t1", 1)  # waits: the one slot is s1's
    assert kernel.waker.wakes > woken_by_queue, "a queued session woke nobody"
    before_finish = kernel.waker.wakes
    await keeper.finish("s1", lease.epoch, "A", read_through=3, sticky_ms=WINDOW_MS)
    assert kernel.waker.wakes > before_finish, "the slot s2 waits for came back unannounced"
    claimed = await other.claim("B")
    assert claimed is not None and claimed.session_id == "s2"


@pytest.mark.parametrize("size", [100, MAX_WAKE_FACTS_BYTES + 1])
async def test_a_wake_carries_the_facts_its_input_came_with(
    kernel: KernelServer, keeper: KernelClient, size: int
) -> None:
    """What the Enqueue brought goes on with the wake (the runner then
    reads nothing), unless it is larger than a wake carries."""
    await kept(keeper, "s1")
    page = b"x" * size  # opaque to the kernel
    await keeper.enqueue("s1", "t1", 2, facts=page)
    woken = await asyncio.wait_for(keeper.next_wake(), DEADLINE_S)
    assert woken.facts == (page if size <= MAX_WAKE_FACTS_BYTES else b"")


async def test_an_input_before_the_finish_holds_the_lease_on(
    kernel: KernelServer, keeper: KernelClient
) -> None:
    """The next input came while the turn was still held (its answer seen,
    its Finish not yet sent): the Finish asking for a window holds the lease
    on, same epoch, for the keeper to answer that input at once."""
    await keeper.enqueue("s1", "t1", 1)
    lease = await keeper.claim("A")
    assert lease is not None
    await keeper.enqueue("s1", "t1", 2)
    held_on = await keeper.finish("s1", lease.epoch, "A", read_through=1, sticky_ms=WINDOW_MS)
    assert held_on.continued and not held_on.requeued and held_on.sticky_until_ms == 0
    info = await keeper.get_lease("s1")
    assert info.lease is not None and info.lease.epoch == lease.epoch
    assert leases(kernel).slots("t1")[0] == 1, "still held: its slot too"
    kept_now = await keeper.finish("s1", lease.epoch, "A", read_through=2, sticky_ms=WINDOW_MS)
    assert kept_now.sticky_until_ms > 0 and not kept_now.continued
    # Without a window asked for, the same race re-queues the session instead.
    await keeper.enqueue("s2", "t1", 1)
    other = await keeper.claim("A")
    assert other is not None and other.session_id == "s2"
    await keeper.enqueue("s2", "t1", 2)
    requeued = await keeper.finish("s2", other.epoch, "A", read_through=1)
    assert requeued.requeued and not requeued.continued
