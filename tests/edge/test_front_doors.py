"""One scenario table, run over both front doors of the edge: the HTTP API
(SPEC §7) and the public gRPC API (SPEC §11). Each row expects the same
outcome through either door; a refusal is the same outcome mapped per door
(404 / NOT_FOUND, ...), with the door's reason (the HTTP error code, the
gRPC ErrorInfo reason) and, over gRPC, the field it refused.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from edge.grpc_api import SERVICE_NAME as SESSION_SERVICE
from services.runner.server import RunnerServer
from tests.support.edge_stack import ADMIN_KEY, Stack
from tests.support.front_doors import (
    DEADLINE_S,
    Event,
    EventStream,
    FrontDoor,
    GrpcDoor,
    Refused,
)
from tests.support.keel_up import keel_up
from tests.support.polling import eventually

OTHER_TENANT_KEY = "front-doors-tenant-b-key-0123456789"


@dataclass(frozen=True)
class Expected:
    """A refusal as each door reports it."""

    outcome: str
    http_code: str
    grpc_reason: str
    # The field the gRPC ErrorInfo names (HTTP says it in the message).
    field: str | None = None

    async def of(self, door: FrontDoor, call: Awaitable[Any]) -> Refused:
        with pytest.raises(Refused) as caught:
            await call
        refused = caught.value
        assert refused.outcome == self.outcome, refused
        assert refused.message, refused
        if door.name == "http":
            assert refused.reason == self.http_code, refused
        else:
            assert refused.reason == self.grpc_reason, refused
            assert refused.field == self.field, refused
        return refused


SESSION_NOT_FOUND = Expected("not_found", "not_found", "SESSION_NOT_FOUND")
UNAUTHENTICATED = Expected("unauthenticated", "unauthorized", "UNAUTHENTICATED")


def invalid(field: str) -> Expected:
    return Expected("invalid_argument", "bad_request", "INVALID_ARGUMENT", field)


def out_of_range(field: str) -> Expected:
    return Expected("invalid_argument", "seq_out_of_range", "SEQ_OUT_OF_RANGE", field)


async def read_until(
    stream: EventStream, done: Callable[[Event], bool], into: list[Event] | None = None
) -> list[Event]:
    """Events up to and including the first that is `done`."""
    events = into if into is not None else []
    deadline = time.monotonic() + DEADLINE_S
    while True:
        event = await stream.next(max(deadline - time.monotonic(), 0.01))
        assert event is not None, "the stream ended early"
        events.append(event)
        if done(event):
            return events


def answers(input_seq: int) -> Callable[[Event], bool]:
    """The final answer to input `input_seq` (no tool call left to make)."""

    def matches(event: Event) -> bool:
        return (
            event.kind == "assistant"
            and input_seq in (event.data.get("inputSeqs") or ())
            and not event.data.get("toolCalls")
        )

    return matches


def facts(events: list[Event]) -> list[Event]:
    return [e for e in events if e.type == "fact"]


# ------------------------------------------------------------------ rows


async def test_create_and_describe_a_session(door: FrontDoor) -> None:
    assert await door.create_session("front-1") == "front-1"
    state = await door.get_session("front-1")
    # A new session holds one fact: session_created.
    assert (state.head_seq, state.status, state.owed_inputs) == (1, "idle", ())
    taken = Expected("conflict", "conflict", "SESSION_EXISTS")
    await taken.of(door, door.create_session("front-1"))
    made = await door.create_session()
    assert made and made != "front-1"


async def test_inputs_are_idempotent_by_request_id(door: FrontDoor) -> None:
    session = await door.create_session()
    first = await door.send_input(session, "hello", "req-1")
    assert (first.duplicate, first.request_id) == (False, "req-1")
    again = await door.send_input(session, "hello", "req-1")
    assert (again.seq, again.duplicate) == (first.seq, True)
    conflict = Expected("conflict", "conflict", "IDEMPOTENCY_CONFLICT")
    await conflict.of(door, door.send_input(session, "another body", "req-1"))
    # Without a request id the edge makes one: each send is a new input.
    made = [await door.send_input(session, "again") for _ in range(2)]
    assert made[0].request_id != made[1].request_id
    assert [m.seq for m in made] == [first.seq + 1, first.seq + 2]
    state = await door.get_session(session)
    assert state.head_seq == made[1].seq
    assert set(state.owed_inputs) == {first.seq, made[0].seq, made[1].seq}


async def test_the_answer_is_streamed(door: FrontDoor, runner: RunnerServer) -> None:
    session = await door.create_session()
    stream = await door.events(session, 0)
    try:
        sent = await door.send_input(session, "hello there", "turn-1")
        events = await read_until(stream, answers(sent.seq))
    finally:
        await stream.close()
    seqs = [e.seq for e in facts(events)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert [e.data["text"] for e in facts(events) if e.kind == "input"] == ["hello there"]
    answer = events[-1].data
    text = "".join(p["text"] for p in answer["content"] if p["type"] == "text")
    previewed = "".join(
        e.data["text"]
        for e in events
        if e.type == "delta"
        and e.data["generationId"] == answer["generationId"]
        and e.data["channel"] == "text"
    )
    assert text and previewed == text


async def test_a_stream_resumes_at_any_cursor(door: FrontDoor, stack: Stack) -> None:
    session = await door.create_session()
    head = await stack.append_inputs(session, 30)
    cursors = [*sorted(random.Random(11).sample(range(head), 6)), 0, head - 1]
    for cursor in cursors:
        stream = await door.events(session, cursor)
        try:
            events = await read_until(stream, lambda e: e.seq == head)
        finally:
            await stream.close()
        assert [e.seq for e in facts(events)] == list(range(cursor + 1, head + 1)), cursor
    # At the head: nothing yet, then the next fact is head + 1.
    stream = await door.events(session, head)
    try:
        sent = await door.send_input(session, "after the head", "next-1")
        events = await read_until(stream, lambda e: e.type == "fact")
    finally:
        await stream.close()
    assert sent.seq == head + 1 and facts(events)[0].seq == head + 1
    # A cursor from the future is refused, not waited for.
    await out_of_range("after").of(door, door.events(session, head + 2))


async def test_a_tool_call_gets_exactly_one_result(door: FrontDoor, runner: RunnerServer) -> None:
    session = await door.create_session()
    stream = await door.events(session, 0)
    try:
        sent = await door.send_input(session, '/tool counter {"key": "front"}', "tool-1")
        events = await read_until(stream, answers(sent.seq))
    finally:
        await stream.close()
    calls = [
        c for e in facts(events) if e.kind == "assistant" for c in e.data.get("toolCalls") or ()
    ]
    assert [c["name"] for c in calls] == ["counter"]
    results = [e for e in facts(events) if e.kind == "tool_result"]
    assert [r.data["toolCallId"] for r in results] == [calls[0]["id"]]


async def test_a_retry_asks_the_input_again(door: FrontDoor, stack: Stack) -> None:
    session = await door.create_session()
    original = await door.send_input(session, "ask me twice", "orig-1")
    retried = await door.retry(session, original.seq, "retry-1")
    assert (retried.seq, retried.duplicate) == (original.seq + 1, False)
    again = await door.retry(session, original.seq, "retry-1")
    assert (again.seq, again.duplicate) == (retried.seq, True)
    recorded = {f.seq: f.data for f in await stack.facts(session)}
    assert recorded[retried.seq] == {
        "text": "ask me twice",
        "requestId": "retry-1",
        "retryOf": original.seq,
    }
    await invalid("seq").of(door, door.retry(session, 0))


async def test_a_cancel_stops_what_runs(door: FrontDoor, runner: RunnerServer) -> None:
    session = await door.create_session()
    # Nothing runs or is owed: nothing is committed.
    assert await door.cancel(session) is None
    assert (await door.get_session(session)).head_seq == 1
    stream = await door.events(session, 0)
    try:
        sent = await door.send_input(session, "/slow 60 a very slow answer", "slow-1")
        await read_until(stream, lambda e: e.kind == "epoch_started")
        cancelled = await door.cancel(session)
        assert cancelled is not None and cancelled > sent.seq
        events = await read_until(stream, lambda e: e.seq == cancelled)
    finally:
        await stream.close()
    assert events[-1].kind == "cancelled"

    async def settled() -> bool:
        state = await door.get_session(session)
        return state.status == "idle" and not state.owed_inputs

    await eventually(settled, "idle after the cancel")


async def test_another_tenant_finds_nothing(door: FrontDoor, stack: Stack) -> None:
    await stack.cluster.kernel.create_tenant("tenant-b", "Tenant B")
    await stack.cluster.kernel.create_api_key("tenant-b", OTHER_TENANT_KEY)
    session = await door.create_session()
    first = await door.send_input(session, "mine", "mine-1")
    other = door.with_key(OTHER_TENANT_KEY)
    refusals: list[Callable[[], Awaitable[Any]]] = [
        lambda: other.get_session(session),
        lambda: other.send_input(session, "theirs", "theirs-1"),
        lambda: other.events(session, 0),
        lambda: other.retry(session, first.seq),
        lambda: other.cancel(session),
        lambda: other.get_context(session),
        # A session that exists nowhere looks the same.
        lambda: other.get_session("never-created"),
    ]
    for call in refusals:
        await SESSION_NOT_FOUND.of(door, call())
    # Ids are per tenant: B may have its own session of that name.
    assert await other.create_session(session) == session
    assert (await other.get_session(session)).head_seq == 1
    inputs = [(f.seq, f.data["text"]) for f in await stack.facts(session) if f.kind == "input"]
    assert inputs == [(first.seq, "mine")]


async def test_no_unknown_or_revoked_key_is_let_in(door: FrontDoor, stack: Stack) -> None:
    session = await door.create_session()
    await UNAUTHENTICATED.of(door, door.with_key(None).get_session(session))
    await UNAUTHENTICATED.of(door, door.with_key("no-such-key-0123456789").get_session(session))
    key, key_id = await stack.cluster.kernel.create_api_key("default")
    holder = door.with_key(key)
    assert (await holder.get_session(session)).head_seq == 1  # known, and cached
    assert await stack.cluster.kernel.revoke_api_key(key_id)

    async def refused() -> bool:
        try:
            await holder.get_session(session)
        except Refused as error:
            assert error.outcome == "unauthenticated", error
            return True
        return False

    await eventually(refused, "refused after the revocation")
    await UNAUTHENTICATED.of(door, holder.send_input(session, "still here?", "revoked-1"))
    await UNAUTHENTICATED.of(door, holder.events(session, 0))


async def test_bad_input_is_refused_with_a_reason(door: FrontDoor) -> None:
    await invalid("id").of(door, door.create_session("no spaces allowed"))
    session = await door.create_session()
    await invalid("requestId").of(door, door.send_input(session, "hi", "bad request id"))
    await invalid("text").of(door, door.send_input(session, "x" * (256 * 1024 + 1), "long-1"))
    await invalid("id").of(door, door.get_session("bad*id"))
    sent = await door.send_input(session, "hi", "ok-1")
    await out_of_range("at").of(door, door.get_context(session, sent.seq + 5))
    await invalid("seq").of(door, door.retry(session, sent.seq + 5))
    # None of it reached the session.
    assert (await door.get_session(session)).head_seq == sent.seq


async def test_the_loadout_is_read_and_written_by_revision(door: FrontDoor, stack: Stack) -> None:
    first, _ = await door.get_loadout()
    written = await door.put_loadout({"systemPrompt": "Be brief."})
    assert written > first
    assert await door.get_loadout() == (written, {"systemPrompt": "Be brief."})
    # A write that expects the latest revision succeeds, once.
    again = await door.put_loadout({"systemPrompt": "Be briefer."}, expected_revision=written)
    stale = Expected("failed_precondition", "precondition_failed", "REVISION_MISMATCH")
    await stale.of(door, door.put_loadout({"systemPrompt": "Lost."}, expected_revision=written))
    wrong = Expected("invalid_argument", "invalid_loadout", "INVALID_LOADOUT", "model.provider")
    await wrong.of(door, door.put_loadout({"model": {"provider": "nope"}}))
    assert (await door.get_loadout())[0] == again
    # Only the tenant's admin keys manage its loadout.
    plain, _ = await stack.cluster.kernel.create_api_key("default")
    denied = Expected("permission_denied", "forbidden", "PERMISSION_DENIED")
    await denied.of(door, door.with_key(plain).get_loadout())


async def test_the_context_shows_what_the_model_saw(door: FrontDoor, runner: RunnerServer) -> None:
    session = await door.create_session()
    stream = await door.events(session, 0)
    try:
        sent = await door.send_input(session, "remember the word lantern", "ctx-1")
        events = await read_until(stream, answers(sent.seq))
    finally:
        await stream.close()
    head = facts(events)[-1].seq
    built = await door.get_context(session)
    assert built["at"] == head
    said = [m for m in built["messages"] if m["role"] == "user"]
    assert said and "lantern" in str(said[0]["content"])
    before = await door.get_context(session, sent.seq)
    assert before["at"] == sent.seq and before["watermark"] == sent.seq


async def test_a_draining_edge_says_so_and_ends_the_stream(door: FrontDoor, stack: Stack) -> None:
    session = await door.create_session()
    sent = await door.send_input(session, "before the drain", "drain-1")
    stream = await door.events(session, 0)
    try:
        await read_until(stream, lambda e: e.seq == sent.seq)
        stack.gateway.start_draining()
        drained = await read_until(stream, lambda e: e.type == "drain")
        assert drained[-1].data == {"retry_after_ms": 250}
        assert await stream.next() is None
    finally:
        await stream.close()


# ------------------------------------------------------------------ serving


async def test_the_grpc_port_serves_health_and_reflection(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        checked = await health.Check(health_pb2.HealthCheckRequest(service=SESSION_SERVICE))
        assert checked.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        asked = reflection_pb2.ServerReflectionRequest(list_services="")
        async for answer in reflection.ServerReflectionInfo(iter([asked])):
            listed = {s.name for s in answer.list_services_response.service}
            assert SESSION_SERVICE in listed
            break


def test_keel_up_serves_the_grpc_api_and_says_where(tmp_path: Path) -> None:
    with keel_up(tmp_path / "data", ADMIN_KEY, "--grpc-port", "0") as running:
        said = re.search(r"^gRPC API: (127\.0\.0\.1:\d+)$", running.child.output(), re.M)
        assert said is not None, running.child.output()
        record = json.loads(running.discovery_file.read_text())
        assert record["grpc"] == said.group(1)

        async def create_one() -> str:
            door = GrpcDoor(said.group(1), ADMIN_KEY)
            try:
                return await door.create_session("through-grpc")
            finally:
                await door.close()

        assert asyncio.run(create_one()) == "through-grpc"
        listed = httpx.get(
            f"{running.url}/v1/sessions", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        assert [s["id"] for s in listed.json()["sessions"]] == ["through-grpc"]
