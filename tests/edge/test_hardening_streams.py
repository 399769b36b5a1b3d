"""Event streams are limited per key and per tenant, and leave nothing behind.

Attacks reproduced:
- 2,000 SSE streams from one key were all accepted, slowing every other
  tenant, and their state outlived them;
- a cancelled upstream call reached the client as `CANCELLED: CANCELLED`.

The limit counts HTTP SSE and gRPC StreamEvents together. Beyond it: 429
`too_many_streams` (gRPC RESOURCE_EXHAUSTED, TOO_MANY_STREAMS) naming the
limit; another tenant is still served. Once the streams close the fan-out
holds no client of theirs and the counts are gone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from edge.errors import from_service_error
from edge.limits import ClientLimits
from edge.server import EdgeServer
from services.common.errors import error_from_rpc, reasons_of
from services.ledger.errors import LedgerError
from tests.support.edge_stack import ADMIN_KEY, DEADLINE_S, Stack
from tests.support.front_doors import EventStream, FrontDoor, GrpcDoor, HttpDoor, Refused
from tests.support.polling import eventually
from tests.support.slow_clients import RawClient, limited_edge, open_stream

SECOND_KEY = "second-default-key-abcdefghijkl"
OTHER_KEY = "globex-tenant-key-abcdefghijklm"
FLOOD = 2000
FLOOD_LIMIT = 50


async def make_keys(stack: Stack) -> None:
    kernel = stack.cluster.kernel
    await kernel.create_api_key("default", SECOND_KEY)
    await kernel.create_tenant("globex")
    await kernel.create_api_key("globex", OTHER_KEY)


async def refused(door: FrontDoor, session: str) -> Refused:
    with pytest.raises(Refused) as caught:
        stream = await door.events(session, 0)
        await stream.close()
    return caught.value


async def first_fact(stream: EventStream) -> str:
    event = await stream.next()
    assert event is not None and event.type == "fact", event
    return event.kind


async def nothing_held(edge: EdgeServer) -> None:
    """The fan-out has no client and no session left, and no stream is counted."""
    assert edge.gateway is not None
    fanout, streams = edge.gateway.fanout, edge.guards.streams

    async def empty() -> bool | None:
        held = (fanout.clients, fanout.sessions, streams.open, streams.tracked)
        return True if held == (0, 0, 0, 0) else None

    await eventually(empty, "every stream's state to be freed", DEADLINE_S)


async def test_streams_beyond_the_key_and_tenant_limits_get_429(stack: Stack) -> None:
    await make_keys(stack)
    limits = ClientLimits(streams_per_key=3, streams_per_tenant=5)
    async with limited_edge(stack, limits) as edge:
        assert edge.grpc_address is not None
        http = HttpDoor(edge.url, ADMIN_KEY)
        grpc_door = GrpcDoor(edge.grpc_address, ADMIN_KEY)
        second, other = http.with_key(SECOND_KEY), http.with_key(OTHER_KEY)
        streams: list[EventStream] = []
        try:
            session = await http.create_session()
            # Three for the key, over both doors.
            streams += [await http.events(session, 0), await http.events(session, 0)]
            streams.append(await grpc_door.events(session, 0))
            over_key = await refused(http, session)
            assert over_key.reason == "too_many_streams", over_key
            assert "API key" in over_key.message
            over_key_grpc = await refused(grpc_door, session)
            assert over_key_grpc.outcome == "grpc RESOURCE_EXHAUSTED", over_key_grpc
            assert over_key_grpc.reason == "TOO_MANY_STREAMS"

            # Two more for the tenant, through another of its keys.
            streams += [await second.events(session, 0), await second.events(session, 0)]
            over_tenant = await refused(second, session)
            assert over_tenant.reason == "too_many_streams"
            assert "tenant" in over_tenant.message

            # Another tenant is served: its stream, and an input on it.
            theirs = await other.create_session()
            their_stream = await other.events(theirs, 0)
            streams.append(their_stream)
            assert await first_fact(their_stream) == "session_created"
            sent = await other.send_input(theirs, "still served", "r-1")
            event = await their_stream.next()
            assert event is not None and (event.seq, event.kind) == (sent.seq, "input")
            for stream in streams[:3]:
                assert await first_fact(stream) == "session_created"
        finally:
            for stream in streams:
                await stream.close()
            await grpc_door.close()
            await http.close()
        await nothing_held(edge)

        # Room again for the key.
        http = HttpDoor(edge.url, ADMIN_KEY)
        try:
            again = await http.events(session, 0)
            assert await first_fact(again) == "session_created"
            await again.close()
        finally:
            await http.close()


async def test_two_thousand_streams_from_one_key_leave_another_tenant_served(
    stack: Stack,
) -> None:
    await make_keys(stack)
    limits = ClientLimits(streams_per_key=FLOOD_LIMIT)
    async with limited_edge(stack, limits) as edge:
        http = HttpDoor(edge.url, ADMIN_KEY)
        other = http.with_key(OTHER_KEY)
        opened: list[RawClient] = []
        try:
            session = await http.create_session()
            path = f"/v1/sessions/{session}/events"
            gate = asyncio.Semaphore(200)

            async def one() -> int:
                async with gate:
                    status, client = await open_stream(edge.port, path, ADMIN_KEY, DEADLINE_S)
                if status == 200:
                    opened.append(client)
                else:
                    await client.close()
                return status

            flood = asyncio.gather(*(one() for _ in range(FLOOD)))
            # Another tenant, while the flood goes on.
            theirs = await other.create_session()
            their_stream = await other.events(theirs, 0)
            assert await first_fact(their_stream) == "session_created"
            statuses = await flood
            assert statuses.count(200) == FLOOD_LIMIT
            assert statuses.count(429) == FLOOD - FLOOD_LIMIT
            # Still served once the flood is in.
            sent = await other.send_input(theirs, "after the flood", "r-1")
            event = await their_stream.next()
            assert event is not None and event.seq == sent.seq
            await their_stream.close()
        finally:
            await asyncio.gather(*(client.close() for client in opened))
            await http.close()
        await nothing_held(edge)


def test_a_cancelled_upstream_call_is_reported_in_words() -> None:
    metadata: Any = grpc.aio.Metadata()
    cancelled = grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, metadata, metadata, "CANCELLED", "cancelled by the peer"
    )
    mapped = from_service_error(error_from_rpc(cancelled, LedgerError, reasons_of(LedgerError)))
    assert mapped.status == 503
    assert "CANCELLED" not in mapped.message
    assert "cancelled" in mapped.message and "retry" in mapped.message
