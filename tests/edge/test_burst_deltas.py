"""A client connected before an input sees every delta of a provider that
sends its whole answer in one burst, in order, exactly once, then the answer.

The provider (tests/support/burst_provider.py) writes all the chunks of an
answer at once, on the OpenAI wire and on the Anthropic wire: the runner
publishes every delta back to back and commits the answer a moment later,
so the answer's fact races its own deltas to the edge (the ledger's stream
against the runner's). An SSE client and a gRPC StreamEvents client follow
the session from before the first input. Each round is one input answered
by a tool call whose arguments come in fragments, then a text answer in
many pieces; every round, both clients must get every fragment and every
piece of the attempt that committed the answer, before the answer, and
their concatenations must be exactly what was committed.

Below, the two halves of how: the runner's hub marks its stream after each
commit, and the edge's merge lets a fact of the watched attempt out only
once a mark covers it (driven directly, with the interleavings forced).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from edge import fanout_merge
from edge.fanout_merge import Attempt, Merged, SessionMerge
from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from services.cli.chat_view import SseEvent
from services.common.config import Settings
from services.ledger import CommittedFact
from services.runner.hub import (
    Committed,
    Partial,
    PartialHub,
    ReplayEnd,
    StatusChange,
)
from services.runner.server import RunnerServer
from tests.support.burst_provider import (
    BurstProvider,
    anthropic_text,
    anthropic_tool_call,
    openai_text,
    openai_tool_call,
)
from tests.support.edge_stack import ADMIN_KEY, DEADLINE_S, Stack
from tests.support.front_doors import delta_fields
from tests.support.polling import eventually
from tests.support.ports import free_port
from tests.support.sse import SseReader, parse

ROUNDS = 10
TEXT_PIECES = 22
# `{ "tz" : "UTC" }`, one character a fragment: 16 tool-argument deltas.
ARGUMENTS = '{ "tz" : "UTC" }'


@dataclass(frozen=True)
class Wire:
    provider: str
    base_path: str
    text: Callable[[list[str]], list[str]]
    tool_call: Callable[[str, str, list[str]], list[str]]


WIRES = {
    "openai": Wire("openai", "/v1", openai_text, openai_tool_call),
    "anthropic": Wire("anthropic", "", anthropic_text, anthropic_tool_call),
}


@dataclass(frozen=True)
class Seen:
    """One event as a client saw it, from either front door."""

    kind: str  # a fact's kind, "delta" or "status"
    data: dict[str, Any]


@pytest.fixture
def burst_port() -> int:
    return free_port()


@pytest.fixture
def pg_settings(pg_settings: Settings, burst_port: int) -> Settings:
    """The stack's settings, with the operator allowing the provider's origin."""
    allowed = pg_settings.secrets.with_origin(f"http://127.0.0.1:{burst_port}")
    return pg_settings.with_overrides(secrets=allowed)


@pytest.fixture
async def provider(burst_port: int) -> AsyncIterator[BurstProvider]:
    async with BurstProvider(port=burst_port) as server:
        yield server


def sse_seen(event: SseEvent) -> Seen:
    """A fact's payload is {seq, kind, epoch, data, ...}; a delta's is the delta."""
    return Seen(event.event, parse(event))


def grpc_seen(message: pb.StreamEventsResponse) -> Seen:
    which = message.WhichOneof("event")
    if which == "fact":
        fact = message.fact
        data = {"seq": fact.seq, "epoch": fact.epoch, "data": json.loads(fact.data_json)}
        return Seen(fact.kind, data)
    if which == "delta":
        return Seen("delta", delta_fields(message.delta))
    return Seen(which or "", {})


def answers_input(seq: int) -> Callable[[Seen], bool]:
    def matches(seen: Seen) -> bool:
        return seen.kind == "assistant" and seq in (seen.data["data"].get("inputSeqs") or ())

    return matches


async def read_sse_until(sse: SseReader, done: Callable[[Seen], bool], into: list[Seen]) -> None:
    while True:
        event = await sse.next()
        assert event is not None, "the SSE stream ended"
        into.append(sse_seen(event))
        if done(into[-1]):
            return


async def read_grpc_until(call: Any, done: Callable[[Seen], bool], into: list[Seen]) -> None:
    while True:
        message = await asyncio.wait_for(call.read(), DEADLINE_S)
        assert message is not grpc.aio.EOF, "the gRPC stream ended"  # type: ignore[attr-defined]
        into.append(grpc_seen(message))
        if done(into[-1]):
            return


def previews(seen: list[Seen]) -> list[tuple[dict[str, Any], list[str], list[str]]]:
    """For each answer in `seen`: the answer, and the non-empty text pieces
    and tool-argument fragments of the attempt that committed it, in the
    order they came, all before the answer."""
    found = []
    attempt: tuple[int, str] = (0, "")
    for position, item in enumerate(seen):
        if item.kind == "epoch_started":
            attempt = (item.data["data"]["epoch"], item.data["data"]["attemptId"])
        if item.kind != "assistant":
            continue
        answer = item.data["data"]
        mine = [
            earlier.data
            for earlier in seen[:position]
            if earlier.kind == "delta"
            and earlier.data["generationId"] == answer["generationId"]
            and (earlier.data["epoch"], earlier.data["attemptId"]) == attempt
        ]
        texts = [d["text"] for d in mine if d["channel"] == "text" and d["text"]]
        fragments = [d["text"] for d in mine if d["channel"] == "tool_call" and d["text"]]
        found.append((answer, texts, fragments))
    return found


def check_round(seen: list[Seen], pieces: list[str], door: str, round_: int) -> None:
    """The round's two answers are the last two of everything `seen`: a
    runner that keeps the session answers every round under the attempt the
    first round's epoch_started named."""
    (call_answer, call_texts, fragments), (text_answer, texts, call_fragments) = previews(seen)[-2:]
    where = f"{door}, round {round_}"
    assert fragments == list(ARGUMENTS), f"{where}: tool-argument deltas {fragments}"
    assert not call_texts and not call_fragments, where
    (call,) = call_answer["toolCalls"]
    assert json.loads("".join(fragments)) == call["arguments"], where
    assert texts == pieces, f"{where}: {len(texts)} of {len(pieces)} text deltas: {texts}"
    committed = "".join(part["text"] for part in text_answer["content"] if part["type"] == "text")
    assert "".join(texts) == committed, where


def check_nothing_after_its_answer(seen: list[Seen], door: str) -> None:
    """No delta of a generation after its answer (it would start a preview
    that no fact ever ends)."""
    answered: set[str] = set()
    for item in seen:
        if item.kind == "assistant":
            answered.add(item.data["data"]["generationId"])
        elif item.kind == "delta":
            assert item.data["generationId"] not in answered, f"{door}: {item.data}"


@pytest.mark.parametrize("wire_name", sorted(WIRES))
async def test_a_client_connected_before_sees_every_delta_of_a_burst(
    stack: Stack, runner: RunnerServer, provider: BurstProvider, wire_name: str
) -> None:
    wire = WIRES[wire_name]
    await stack.cluster.kernel.put_loadout(
        "default",
        {
            "model": {
                "provider": wire.provider,
                "name": "burst-model",
                "baseUrl": f"{provider.url}{wire.base_path}",
            },
            "tools": ["clock"],
        },
    )
    session = await stack.new_session()
    channel = grpc.aio.insecure_channel(stack.grpc_address)
    stub = pb_grpc.SessionServiceStub(channel)
    call = stub.StreamEvents(
        pb.StreamEventsRequest(session_id=session),
        metadata=(("authorization", f"Bearer {ADMIN_KEY}"),),
    )
    by_sse: list[Seen] = []
    by_grpc: list[Seen] = []
    try:
        await call.initial_metadata()
        async with SseReader(stack.http, session) as sse:
            # Both clients follow the session before the first input.
            await eventually(lambda: stack.gateway.fanout.clients == 2, "both clients to join")
            for round_ in range(ROUNDS):
                pieces = [f"r{round_}p{i} " for i in range(TEXT_PIECES)]
                provider.queue(
                    wire.tool_call(f"call_{round_}", "clock", list(ARGUMENTS)),
                    wire.text(pieces),
                )
                posted = await stack.post_input(session, f"round {round_}", f"req-{round_}")
                assert posted.status_code == 202, posted.text
                done = answers_input(posted.json()["seq"])
                sse_from, grpc_from = len(by_sse), len(by_grpc)
                await read_sse_until(sse, done, by_sse)
                await read_grpc_until(call, done, by_grpc)
                assert len(previews(by_sse[sse_from:])) == 2, "SSE: the round's two answers"
                assert len(previews(by_grpc[grpc_from:])) == 2, "gRPC: the round's two answers"
                check_round(by_sse, pieces, "SSE", round_)
                check_round(by_grpc, pieces, "gRPC", round_)
    finally:
        call.cancel()
        await channel.close(None)
    check_nothing_after_its_answer(by_sse, "SSE")
    check_nothing_after_its_answer(by_grpc, "gRPC")


# ------------------------------------------------ the hub's marks, the merge


async def test_the_hub_marks_its_stream_after_each_commit() -> None:
    hub = PartialHub()
    session = "t:s-1"
    hub.publish(session, StatusChange("running", 1))
    hub.committed(session, 1, 4)
    hub.publish(session, Partial("g", "text", "a", 1, "a1"))
    hub.committed(session, 1, 5)
    events = hub.watch(session, 1, "a1")
    # Marks are not replayed: ReplayEnd says how far the attempt had committed.
    replayed = [await anext(events) for _ in range(3)]
    assert replayed == [
        StatusChange("running", 1),
        Partial("g", "text", "a", 1, "a1"),
        ReplayEnd(1, 5),
    ]
    hub.publish(session, Partial("g", "text", "b", 1, "a1"))
    hub.committed(session, 1, 5)  # nothing new: no mark
    hub.committed(session, 2, 9)  # another attempt's: not this log's
    hub.committed(session, 1, 6)
    live = [await anext(events) for _ in range(2)]
    assert live == [Partial("g", "text", "b", 1, "a1"), Committed(6)]
    hub.release(session)
    assert [event async for event in events] == []


def fact(seq: int, kind: str, writer_epoch: int = 0, **data: Any) -> CommittedFact:
    return CommittedFact("t:s-1", seq, kind, data, 0, writer_epoch)


class Merging:
    """A merge, what it emitted, and the watches it asked for."""

    def __init__(self) -> None:
        self.emitted: list[Merged] = []
        self.watches: list[tuple[int, Attempt | None]] = []
        self.merge = SessionMerge(self.emitted.append, self._start)

    def _start(self, watch: int, attempt: Attempt | None) -> None:
        self.watches.append((watch, attempt))

    def attempt_started(self, seq: int, epoch: int) -> int:
        """Feeds an attempt's epoch_started; returns the watch it asked for."""
        started = fact(seq, "epoch_started", epoch, epoch=epoch, runtimeId="r", attemptId="a")
        self.merge.fact(started)
        watch, attempt = self.watches[-1]
        assert attempt == Attempt("r", epoch, "a")
        return watch

    def seqs(self) -> list[int]:
        return [item.seq for item in self.emitted if isinstance(item, CommittedFact)]


DELTA = Partial("g", "text", "late", 2, "a")


async def test_an_answer_ahead_of_its_deltas_waits_for_their_mark() -> None:
    merging = Merging()
    merge = merging.merge
    merge.watch_owner()
    merge.watch_ended(1)  # nobody owned the session
    watch = merging.attempt_started(1, epoch=2)
    merge.watch_event(watch, StatusChange("running", 2))
    merge.watch_event(watch, ReplayEnd(0, 1))
    # The answer and an input after it come before the answer's deltas.
    merge.fact(fact(2, "assistant", 2, generationId="g"))
    merge.fact(fact(3, "input", text="next"))
    assert merging.seqs() == [1]
    merge.watch_event(watch, DELTA)
    merge.watch_event(watch, Committed(2))
    kinds = [item.kind if isinstance(item, CommittedFact) else item for item in merging.emitted]
    assert kinds == ["epoch_started", StatusChange("running", 2), DELTA, "assistant", "input"]


async def test_facts_do_not_wait_on_a_runner_without_marks() -> None:
    merging = Merging()
    watch = merging.attempt_started(1, epoch=2)
    merging.merge.fact(fact(2, "assistant", 2, generationId="g"))
    assert merging.seqs() == [1]
    merging.merge.watch_event(watch, ReplayEnd(0, None))  # an older runner
    assert merging.seqs() == [1, 2]


async def test_facts_do_not_wait_on_a_silent_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout_merge, "STALL_S", 0.05)
    merging = Merging()
    merging.attempt_started(1, epoch=2)
    merging.merge.fact(fact(2, "assistant", 2, generationId="g"))
    assert merging.seqs() == [1]
    # The runner says nothing (frozen): the answer goes out all the same.
    await eventually(lambda: merging.seqs() == [1, 2], "the answer to go out")


async def test_a_newer_attempt_ends_the_wait_for_the_older_one() -> None:
    merging = Merging()
    merging.attempt_started(1, epoch=2)
    merging.merge.fact(fact(2, "tool_result", 2))
    assert merging.seqs() == [1]
    # A takeover can only follow once the old attempt's fact is out: a fact
    # of the old epoch waits for its mark or its watch's end.
    first_watch = merging.watches[-1][0]
    merging.merge.watch_ended(first_watch)
    assert merging.seqs() == [1, 2]
    merging.attempt_started(3, epoch=3)
    assert merging.seqs() == [1, 2, 3]
    assert [w for w, _ in merging.watches] == [1, 2]
