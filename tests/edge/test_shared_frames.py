"""A fact is encoded once for all the clients of its session, and a client
that waits with nothing pending is written to by the broadcast itself.

- Over real HTTP and gRPC: many SSE and StreamEvents clients follow one
  session; every client gets every fact, in order, and each fact's SSE event
  and gRPC message are each encoded once (counted through the hub's codec).
- On the fan-out with stand-in connections (`Sink`): a parked client's live
  frames reach its connection without its own task running; a connection
  that refuses (its send buffer full: a slow client) gets them through its
  task instead, still in order, none missed or doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter
from typing import Any

import grpc

from edge.fanout import FanoutHub
from edge.frames import Frame, WireCodec
from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from services.ledger import CommittedFact
from tests.support.edge_stack import ADMIN_KEY, DEADLINE_S, Stack
from tests.support.polling import eventually
from tests.support.sse import SseReader

SSE_CLIENTS = 30
GRPC_CLIENTS = 10
FACTS = 20
SSE_ID = re.compile(rb"^id: (\d+)", re.MULTILINE)


class CountingCodec(WireCodec):
    """Counts the encodings of each fact, per front door."""

    def __init__(self) -> None:
        self.sse_encodes: Counter[int] = Counter()
        self.grpc_encodes: Counter[int] = Counter()

    def sse(self, item: object) -> bytes | None:
        if isinstance(item, CommittedFact):
            self.sse_encodes[item.seq] += 1
        return super().sse(item)

    def grpc(self, item: object) -> bytes | None:
        if isinstance(item, CommittedFact):
            self.grpc_encodes[item.seq] += 1
        return super().grpc(item)


async def sse_seqs_until(reader: SseReader, last: int) -> list[int]:
    seqs: list[int] = []
    while not seqs or seqs[-1] < last:
        event = await reader.next()
        assert event is not None, "the stream ended"
        if event.id is not None:
            seqs.append(int(event.id))
    return seqs


async def grpc_seqs_until(call: Any, last: int) -> list[int]:
    seqs: list[int] = []
    while not seqs or seqs[-1] < last:
        event = await asyncio.wait_for(call.read(), DEADLINE_S)
        assert event is not grpc.aio.EOF, "the stream ended"  # type: ignore[attr-defined]
        if event.WhichOneof("event") == "fact":
            seqs.append(event.fact.seq)
    return seqs


async def test_each_fact_is_encoded_once_for_all_its_clients(stack: Stack) -> None:
    session = await stack.new_session()
    head = (await stack.facts(session))[-1].seq
    codec = CountingCodec()
    stack.gateway.fanout.codec = codec
    channel = grpc.aio.insecure_channel(stack.grpc_address)
    stub = pb_grpc.SessionServiceStub(channel)
    metadata = (("authorization", f"Bearer {ADMIN_KEY}"),)
    async with contextlib.AsyncExitStack() as streams:
        readers = [
            await streams.enter_async_context(SseReader(stack.http, session, after=head))
            for _ in range(SSE_CLIENTS)
        ]
        calls = [
            stub.StreamEvents(
                pb.StreamEventsRequest(session_id=session, after_seq=head), metadata=metadata
            )
            for _ in range(GRPC_CLIENTS)
        ]
        streams.callback(lambda: [call.cancel() for call in calls])
        await asyncio.gather(*(call.initial_metadata() for call in calls))
        await eventually(
            lambda: stack.gateway.fanout.clients == SSE_CLIENTS + GRPC_CLIENTS,
            "every client to join the session's fan-out",
        )
        # A first fact, read by all: every client is past its own backlog
        # (facts it reads itself are its own frames, encoded for it alone).
        marker = await stack.append_inputs(session, 1, "marker")
        await asyncio.gather(
            *(sse_seqs_until(r, marker) for r in readers),
            *(grpc_seqs_until(c, marker) for c in calls),
        )
        codec.sse_encodes.clear()
        codec.grpc_encodes.clear()

        last = await stack.append_inputs(session, FACTS, "live")
        received = await asyncio.gather(
            *(sse_seqs_until(r, last) for r in readers),
            *(grpc_seqs_until(c, last) for c in calls),
        )
    await channel.close(None)

    expected = list(range(marker + 1, last + 1))
    assert len(expected) == FACTS
    assert all(seqs == expected for seqs in received), received
    assert codec.sse_encodes == dict.fromkeys(expected, 1)
    assert codec.grpc_encodes == dict.fromkeys(expected, 1)


class Sink:
    """A stand-in for a client connection: takes writes while `accepting`."""

    def __init__(self, accepting: int) -> None:
        self.accepting = accepting  # writes it still takes
        self.seqs: list[int] = []

    def write(self, data: bytes) -> bool:
        if self.accepting <= 0:
            return False
        self.accepting -= 1
        self.seqs.extend(int(seq) for seq in SSE_ID.findall(data))
        return True


class Follower:
    """One client of the hub with a sink: what its own task was handed."""

    def __init__(self, hub: FanoutHub, session: str, after: int, sink: Sink) -> None:
        self.sink = sink
        self.seqs: list[int] = []  # facts through the task (not the sink)
        self.wakeups = 0
        self._task = asyncio.create_task(self._read(hub, session, after))

    async def _read(self, hub: FanoutHub, session: str, after: int) -> None:
        async with contextlib.aclosing(hub.follow_frames(session, after, self.sink)) as follow:
            async for batch in follow:
                self.wakeups += 1
                self.seqs.extend(_fact_seqs(batch))

    def all_seqs(self) -> list[int]:
        return sorted(self.sink.seqs + self.seqs)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def _fact_seqs(batch: list[Frame]) -> list[int]:
    return [f.item.seq for f in batch if isinstance(f.item, CommittedFact)]


async def no_runner(_: str) -> None:
    return None


async def test_parked_clients_are_written_by_the_broadcast_and_slow_ones_by_their_task(
    stack: Stack,
) -> None:
    session = stack.ledger_id(await stack.new_session())
    head = (await stack.cluster.ledger.get_session(session)).head_seq
    hub = FanoutHub(stack.cluster.ledger, no_runner, no_runner)
    fast = [Follower(hub, session, head, Sink(accepting=10**6)) for _ in range(20)]
    slow = Follower(hub, session, head, Sink(accepting=0))
    # Takes a few frames, then its buffer is full for good.
    stalls = Follower(hub, session, head, Sink(accepting=3))
    everyone = [*fast, slow, stalls]
    try:
        marker = await stack.append_inputs(session.split(":", 1)[1], 1, "marker")
        await eventually(
            lambda: all(f.all_seqs() == [marker] for f in everyone), "the marker to reach all"
        )
        woken = [f.wakeups for f in fast]
        last = await stack.append_inputs(session.split(":", 1)[1], FACTS, "live")
        expected = list(range(marker + 1, last + 1))
        await eventually(
            lambda: all(f.all_seqs()[-1:] == [last] for f in everyone), "every fact to reach all"
        )
        for follower in fast:
            # Every live fact went straight to the connection, in order; the
            # client's own task never ran for them.
            assert follower.sink.seqs[-FACTS:] == expected
            assert follower.seqs in ([], [marker])
        assert [f.wakeups for f in fast] == woken
        # The slow client's task sent them all, in order.
        assert slow.sink.seqs == []
        assert slow.seqs == [marker, *expected]
        # The one that stalled: what its connection took, then the rest
        # through its task, each fact once, in order.
        assert stalls.all_seqs() == [marker, *expected]
        assert len(stalls.sink.seqs) + len(stalls.seqs) == FACTS + 1
        taken = [s for s in stalls.sink.seqs if s > marker]
        assert taken and max(taken) < min(s for s in stalls.seqs if s > marker)
    finally:
        for follower in everyone:
            await follower.close()
