"""A revoked key's open event streams end, on every edge.

Attack reproduced: after `DELETE /v1/keys/{id}` new requests got 401, but an
SSE stream and a gRPC StreamEvents opened with the key kept delivering new
inputs, answers and deltas for as long as they stayed open. Now every edge
ends each stream opened with the key once the revocation reaches it: SSE
with a last `revoked` event and the end of the response, gRPC with
UNAUTHENTICATED (API_KEY_REVOKED); a stream of another key goes on. An edge
cut off from the kernel when the key was revoked ends them when its
revocation watch reconnects and reads what it missed.

Real ledger, kernels, runner and edges on loopback, over HTTP and gRPC;
waits read the streams or poll with a deadline, never sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

import edge.auth
from edge.gateway import EdgeConfig
from edge.key_streams import KeyRevoked, KeyUnconfirmed
from edge.server import EdgeServer
from kernel import KernelServer
from kernel.tenancy import hash_key
from services.runner.server import RunnerServer
from tests.support.edge_stack import Stack
from tests.support.front_doors import (
    Event,
    EventStream,
    FrontDoor,
    GrpcDoor,
    HttpDoor,
    Refused,
)
from tests.support.polling import eventually

# A failure bound for a stream to end (or an event to come), far above what
# it takes; it is never waited out when things work.
WITHIN_S = 20.0


@pytest.fixture
async def second_edge(stack: Stack) -> AsyncIterator[EdgeServer]:
    """Another edge, with its gRPC API, on the same ledger and kernel."""
    cluster = stack.cluster
    other = await EdgeServer(
        cluster.settings,
        EdgeConfig(cluster.ledger_server.target, cluster.kernel_server.target, grpc_port=0),
    ).start()
    yield other
    await other.stop()


def doors(server: EdgeServer, key: str) -> list[FrontDoor]:
    """HTTP and gRPC of `server`, sending `key`."""
    assert server.grpc_address is not None
    return [HttpDoor(server.url, key), GrpcDoor(server.grpc_address, key)]


async def until(stream: EventStream, matches: Callable[[Event], bool]) -> Event:
    """Reads `stream` up to the first event that `matches`."""
    # Reads events as they arrive rather than polling (tests.support.polling):
    # a matching event may be followed by others, and each one read is spent.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN_S
    while True:
        event = await stream.next(max(deadline - loop.time(), 0.001))
        assert event is not None, "the stream ended before the awaited event"
        if matches(event):
            return event


async def answered(stream: EventStream, input_seq: int) -> None:
    """The input's fact then its answer arrive on `stream`."""
    await until(stream, lambda e: (e.type, e.seq) == ("fact", input_seq))
    await until(stream, lambda e: e.kind == "assistant" and input_seq in e.data["inputSeqs"])


async def how_it_ended(stream: EventStream) -> Event | Refused:
    """Reads `stream` until the edge ends it: its last event (SSE), or the
    refusal it ended with (gRPC)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN_S
    last: Event | None = None
    while True:
        remaining = deadline - loop.time()
        try:
            if remaining <= 0:
                raise TimeoutError
            event = await stream.next(remaining)
        except TimeoutError:
            raise AssertionError(f"the stream is still open after {WITHIN_S}s") from None
        except Refused as refused:
            return refused
        if event is None:
            assert last is not None, "the stream ended without a word"
            return last
        last = event


def ended_as_revoked(ending: Event | Refused) -> None:
    if isinstance(ending, Refused):
        assert (ending.outcome, ending.reason) == ("unauthenticated", "API_KEY_REVOKED"), ending
        assert "revoked" in ending.message
    else:
        assert ending.type == "revoked", ending
        assert ending.data["code"] == "key_revoked", ending
        assert "revoked" in ending.data["message"]


async def revoke(stack: Stack, key_id: str) -> None:
    """`DELETE /v1/keys/{id}` with the operator key of `stack`."""
    response = await stack.http.delete(f"/v1/keys/{key_id}")
    assert response.status_code == 200, response.text
    assert response.json()["revoked"] is True


async def test_a_revoked_keys_streams_end_on_every_edge_and_other_keys_flow(
    stack: Stack, runner: RunnerServer, second_edge: EdgeServer
) -> None:
    kernel = stack.cluster.kernel
    key, key_id = await kernel.create_api_key("default")
    kept, _ = await kernel.create_api_key("default")
    edges = [stack.edge, second_edge]
    revoked_doors = [door for server in edges for door in doors(server, key)]
    kept_doors = [door for server in edges for door in doors(server, kept)]
    session = await stack.new_session()
    revoked_streams = [await door.events(session, 0) for door in revoked_doors]
    kept_streams = [await door.events(session, 0) for door in kept_doors]
    try:
        streams = revoked_streams + kept_streams
        for stream in streams:
            await until(stream, lambda e: e.kind == "session_created")
        # Every stream delivers inputs and answers (deltas too, as they come).
        sent = await stack.post_input(session, "before the revocation", "r-1")
        assert sent.status_code == 202, sent.text
        await asyncio.gather(*(answered(stream, sent.json()["seq"]) for stream in streams))
        for server in edges:
            assert server.gateway is not None
            held = server.gateway.auth.streams
            assert (held.count(hash_key(key)), held.count(hash_key(kept))) == (2, 2)

        await revoke(stack, key_id)
        for ending in await asyncio.gather(*(how_it_ended(s) for s in revoked_streams)):
            ended_as_revoked(ending)
        for server in edges:
            assert server.gateway is not None
            assert server.gateway.auth.streams.count(hash_key(key)) == 0

        # Another key's streams, on both edges and both doors, go on.
        again = await stack.post_input(session, "after the revocation", "r-2")
        assert again.status_code == 202, again.text
        await asyncio.gather(*(answered(stream, again.json()["seq"]) for stream in kept_streams))
    finally:
        for stream in revoked_streams + kept_streams:
            await stream.close()
        for door in revoked_doors + kept_doors:
            await door.close()


async def test_an_edge_cut_off_from_the_kernel_ends_them_once_it_reconnects(
    stack: Stack,
) -> None:
    """Edge B follows revocations through a second kernel (a replica on the
    same database), which is down while an operator key is revoked through
    edge A: B cannot know yet and still holds the key's streams; once its
    kernel is back, B's watch reads what it missed and ends them."""
    cluster = stack.cluster
    kernel_b = await KernelServer(
        cluster.settings, ledger_target=cluster.ledger_server.target
    ).start()
    edge_b = await EdgeServer(
        cluster.settings,
        EdgeConfig(cluster.ledger_server.target, kernel_b.target, grpc_port=0),
    ).start()
    key, key_id = await cluster.kernel.create_api_key("default", admin=True, operator=True)
    b_doors = doors(edge_b, key)
    streams: list[EventStream] = []
    try:
        session = await stack.new_session()
        streams = [await door.events(session, 0) for door in b_doors]
        for stream in streams:
            await until(stream, lambda e: e.kind == "session_created")
        assert edge_b.gateway is not None
        auth_b = edge_b.gateway.auth

        address = kernel_b.target
        await kernel_b.stop()
        await revoke(stack, key_id)
        # Edge A knows (a new request there is refused): B, cut off, cannot.
        async with stack.client(key) as http:
            await eventually(lambda: _refused(http), "edge A to refuse the revoked key", WITHIN_S)
        assert auth_b.streams.count(hash_key(key)) == 2

        kernel_b = await KernelServer(
            cluster.settings, address, ledger_target=cluster.ledger_server.target
        ).start()
        for ending in await asyncio.gather(*(how_it_ended(s) for s in streams)):
            ended_as_revoked(ending)
        assert auth_b.streams.count(hash_key(key)) == 0
    finally:
        for stream in streams:
            await stream.close()
        for door in b_doors:
            await door.close()
        await edge_b.stop()
        await kernel_b.stop()


async def _refused(http: httpx.AsyncClient) -> bool | None:
    status = (await http.get("/v1/sessions")).status_code
    return True if status == 401 else None


async def test_the_registry_holds_no_stream_once_they_close(stack: Stack) -> None:
    """Streams that close however they close (the client leaves, a refusal
    after the key was checked) leave nothing registered."""
    kernel = stack.cluster.kernel
    keys = [(await kernel.create_api_key("default"))[0] for _ in range(2)]
    opened = [door for key in keys for door in doors(stack.edge, key)]
    session = await stack.new_session()
    auth = stack.gateway.auth
    try:
        for _ in range(5):
            streams = [await door.events(session, 0) for door in opened for _ in range(2)]
            for stream in streams:
                await until(stream, lambda e: e.kind == "session_created")
            assert auth.streams.count() == len(streams)
            for stream in streams:
                await stream.close()
            for door in opened:
                # A cursor beyond the head: refused once the key was checked.
                with pytest.raises(Refused):
                    await door.events(session, 10_000)
            await eventually(
                lambda: _nothing_held(stack), "every stream to leave the registry", WITHIN_S
            )
    finally:
        for door in opened:
            await door.close()


async def _nothing_held(stack: Stack) -> bool | None:
    streams = stack.gateway.auth.streams
    return True if (streams.count(), streams.keys) == (0, 0) else None


async def test_a_stream_opening_after_its_key_was_revoked_ends_at_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream registers a little after its key was checked (the SSE route
    reads the session first): a revocation that reached the edge in between
    ends it as it opens. Checked on the edge's own authenticator, with a
    real kernel behind it."""
    kernel = stack.cluster.kernel
    auth = stack.gateway.auth
    key, key_id = await kernel.create_api_key("default")
    caller = await auth.authenticate(key)
    seen = auth.revocations_seen
    assert await kernel.revoke_api_key(key_id)
    await eventually(
        lambda: _seen_more(auth, seen), "the edge to learn of the revocation", WITHIN_S
    )
    with auth.open_stream(caller) as late:
        assert isinstance(late.ended_by, KeyRevoked)

    # A check older than the revocations the edge remembers cannot be
    # confirmed: that stream ends too (its client reconnects, checked anew).
    monkeypatch.setattr(edge.auth, "RECENT_REVOCATIONS", 1)
    old, _ = await kernel.create_api_key("default")
    old_caller = await auth.authenticate(old)
    seen = auth.revocations_seen
    for _ in range(2):
        assert await kernel.revoke_api_key((await kernel.create_api_key("default"))[1])
    await eventually(
        lambda: _seen_more(auth, seen + 1), "the edge to learn of the revocations", WITHIN_S
    )
    with auth.open_stream(old_caller) as unconfirmed:
        assert isinstance(unconfirmed.ended_by, KeyUnconfirmed)
    fresh = await kernel.create_api_key("default")
    with auth.open_stream(await auth.authenticate(fresh[0])) as confirmed:
        assert confirmed.ended_by is None
    assert auth.streams.count() == 0


async def _seen_more(auth: edge.auth.Authenticator, than: int) -> bool | None:
    return True if auth.revocations_seen > than else None
