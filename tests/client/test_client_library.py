"""The client library (keel_client) against a real edge's gRPC API: typed
results of every method, one error class per reason, the event iterator
across an edge stopped and started again, and the blocking client."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import Any

import pytest

import keel_client
from keel_client import (
    AsyncKeelClient,
    Cancellation,
    ClientClosed,
    ClientOptions,
    Context,
    Delta,
    Event,
    Fact,
    IdempotencyConflict,
    Input,
    InvalidArgument,
    InvalidLoadout,
    KeelClient,
    Loadout,
    PermissionDenied,
    ReconnectGaveUp,
    ReconnectPolicy,
    RevisionMismatch,
    SeqOutOfRange,
    Session,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    SessionNotParked,
    SessionPage,
    SessionSummary,
    Skip,
    Status,
    Unauthenticated,
)
from services.runner.server import RunnerServer
from tests.support.client_events import DEADLINE_S, answers, fact_seqs, has_seq, read_until
from tests.support.edge_restart import start_edge, stop_edge
from tests.support.edge_stack import ADMIN_KEY, Stack
from tests.support.polling import eventually
from tests.support.ports import free_port

HELLO = "/slow 1 hello there"


async def test_each_method_returns_its_typed_result(
    stack: Stack, runner: RunnerServer, keel: AsyncKeelClient
) -> None:
    assert await keel.create_session("typed-1") == "typed-1"
    made = await keel.create_session()
    assert isinstance(made, str) and made

    seen: list[Event] = []
    events = keel.events("typed-1")
    try:
        # Following the session before the input: its answer streams live,
        # over a second, so the attempt is still running when the edge
        # starts watching its runner (a watch begins with the state of the
        # moment, and an instant answer may be idle again by then).
        await read_until(events, has_seq(1), seen)
        sent = await keel.send_input("typed-1", HELLO, request_id="typed-r1")
        assert sent == Input(seq=sent.seq, duplicate=False, request_id="typed-r1", retry_safe=True)
        again = await keel.send_input("typed-1", HELLO, request_id="typed-r1")
        assert again == Input(seq=sent.seq, duplicate=True, request_id="typed-r1", retry_safe=True)
        answer = await read_until(events, answers(sent.seq), seen)
    finally:
        await events.aclose()
    assert isinstance(answer, Fact) and answer.kind == "assistant"
    assert fact_seqs(seen) == list(range(1, answer.seq + 1))
    assert any(isinstance(e, Delta) and e.channel == "text" and e.text for e in seen)
    assert any(isinstance(e, Status) and e.state == "running" for e in seen)
    facts = [e for e in seen if isinstance(e, Fact)]
    ledger = await stack.facts("typed-1")
    assert [(f.seq, f.kind, dict(f.data)) for f in facts] == [
        (f.seq, f.kind, f.data) for f in ledger[: len(facts)]
    ]

    session = await keel.get_session("typed-1")
    assert isinstance(session, Session)
    assert session.session_id == "typed-1"
    assert session.head_seq >= answer.seq
    assert session.owed_input_seqs == ()
    assert session.status in ("idle", "running")

    first = await keel.list_sessions(page_size=1)
    assert isinstance(first, SessionPage) and len(first.sessions) == 1 and first.next_page_token
    every = [s async for s in keel.iter_sessions(page_size=1)]
    assert all(isinstance(s, SessionSummary) for s in every)
    assert sorted(s.session_id for s in every) == sorted(["typed-1", made])
    assert [s.session_id for s in every] == sorted(s.session_id for s in every)

    context = await keel.get_context("typed-1")
    assert isinstance(context, Context)
    assert context.at_seq == session.head_seq
    assert all(isinstance(m, dict) for m in context.messages)
    assert "hello there" in repr(context.messages)
    assert context.estimated_tokens > 0

    retried = await keel.retry("typed-1", sent.seq, request_id="typed-retry-1")
    assert retried.seq > answer.seq and not retried.duplicate and retried.retry_safe
    unnamed = await keel.send_input("typed-1", "/slow 20 a long answer", request_id=None)
    assert not unnamed.retry_safe and unnamed.request_id
    cancelled = await keel.cancel("typed-1")
    assert cancelled == Cancellation(
        cancelled=True, seq=cancelled.seq, input_seqs=cancelled.input_seqs
    )
    assert unnamed.seq in cancelled.input_seqs
    assert cancelled.seq > unnamed.seq

    parked = await keel.create_session("typed-parked")
    failed = await keel.send_input(parked, "/fail", request_id="typed-fail")

    async def parked_session() -> Session | None:
        got = await keel.get_session(parked)
        return got if got.status == "parked" else None

    stuck = await eventually(parked_session, "the session to be parked")
    assert stuck.parked_on == (failed.seq,) and stuck.parked_reason
    skipped = await keel.skip_inputs(parked)
    assert skipped == Skip(seq=skipped.seq, skipped_input_seqs=(failed.seq,))
    assert skipped.seq > failed.seq

    fork = await keel.fork_session("typed-1", answer.seq)
    assert isinstance(fork, str) and fork != "typed-1"
    assert (await keel.get_session(fork)).head_seq == answer.seq + 1
    edited_in, edited = await keel.edit_input("typed-1", sent.seq, "hello again")
    assert isinstance(edited, Input) and edited.seq == sent.seq + 1
    assert edited_in not in ("typed-1", fork)

    loadout = await keel.get_loadout()
    assert isinstance(loadout, Loadout)
    revision = await keel.put_loadout({"systemPrompt": "Answer briefly."})
    assert revision > loadout.revision
    stored = await keel.get_loadout()
    assert stored.revision == revision
    assert stored.document["systemPrompt"] == "Answer briefly."


async def test_each_refusal_raises_the_class_of_its_reason(
    stack: Stack, grpc_address: str, keel: AsyncKeelClient
) -> None:
    session = await keel.create_session("errors-1")
    sent = await keel.send_input(session, "first", request_id="errors-r1")

    with pytest.raises(SessionNotFound) as missing:
        await keel.get_session("no-such-session")
    assert missing.value.reason == "SESSION_NOT_FOUND"
    assert missing.value.code is not None and missing.value.code.name == "NOT_FOUND"

    with pytest.raises(IdempotencyConflict) as conflict:
        await keel.send_input(session, "another body", request_id="errors-r1")
    assert conflict.value.reason == "IDEMPOTENCY_CONFLICT"

    with pytest.raises(SessionExists):
        await keel.create_session("errors-1")

    with pytest.raises(InvalidArgument) as bad_id:
        await keel.send_input(session, "second", request_id="spaces are not allowed")
    assert bad_id.value.field == "requestId"
    assert type(bad_id.value) is InvalidArgument
    with pytest.raises(InvalidArgument) as too_long:
        await keel.send_input(session, "x" * (256 * 1024 + 1), request_id="errors-r2")
    assert too_long.value.field == "text"
    with pytest.raises(InvalidArgument) as not_an_input:
        await keel.retry(session, 1, request_id="errors-r3")
    assert not_an_input.value.field == "seq"

    # Nothing answers here: "first" is owed, so a rejectable input is refused.
    with pytest.raises(SessionBusy) as busy:
        await keel.send_input(session, "are you there?", request_id="errors-r4", multitask="reject")
    assert busy.value.reason == "SESSION_BUSY"

    with pytest.raises(SessionNotParked) as not_parked:
        await keel.skip_inputs(session)
    assert not_parked.value.reason == "SESSION_NOT_PARKED"

    with pytest.raises(SeqOutOfRange) as beyond:
        await keel.get_context(session, at_seq=sent.seq + 1000)
    assert beyond.value.field == "at"
    # A cursor past the head is refused, not retried.
    with pytest.raises(SeqOutOfRange):
        await anext(keel.events(session, after=sent.seq + 1000))
    with pytest.raises(InvalidArgument) as negative:
        await anext(keel.events(session, after=-1))
    assert negative.value.field == "after"

    with pytest.raises(InvalidLoadout) as loadout:
        await keel.put_loadout({"model": {"provider": "a-provider-that-does-not-exist"}})
    assert loadout.value.field == "model.provider"
    current = await keel.put_loadout({"systemPrompt": "one"})
    await keel.put_loadout({"systemPrompt": "two"}, expected_revision=current)
    with pytest.raises(RevisionMismatch) as stale:
        await keel.put_loadout({"systemPrompt": "three"}, expected_revision=current)
    assert stale.value.reason == "REVISION_MISMATCH"

    async with AsyncKeelClient(grpc_address, "not-a-key-of-anyone-0123456789") as stranger:
        with pytest.raises(Unauthenticated) as unknown:
            await stranger.get_session(session)
        assert unknown.value.reason == "UNAUTHENTICATED"
        with pytest.raises(Unauthenticated):
            await anext(stranger.events(session))

    member_key, _ = await stack.cluster.kernel.create_api_key("default", admin=False)
    async with AsyncKeelClient(grpc_address, member_key) as member:
        assert (await member.get_session(session)).session_id == session
        with pytest.raises(PermissionDenied):
            await member.put_loadout({"systemPrompt": "mine"})

    await stack.cluster.kernel.create_tenant("other", "Another tenant")
    other_key, _ = await stack.cluster.kernel.create_api_key("other", admin=True)
    async with AsyncKeelClient(grpc_address, other_key) as other:
        # Another tenant's session is not found, as if it did not exist.
        with pytest.raises(SessionNotFound):
            await other.get_session(session)
        with pytest.raises(SessionNotFound):
            await anext(other.events(session))


async def test_events_resume_across_an_edge_stopped_and_started_on_the_same_port(
    stack: Stack, runner: RunnerServer, grpc_address: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="keel_client")

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name.startswith("keel_client")]

    # Quick retries, so the test does not wait out a long backoff while the
    # edge is down; the schedule itself is the same code.
    options = ClientOptions(reconnect=ReconnectPolicy(max_backoff_s=0.5, give_up_after_s=60))
    async with AsyncKeelClient(grpc_address, ADMIN_KEY, options=options) as keel:
        session = await keel.create_session()
        first = await keel.send_input(session, "before the restart", request_id="restart-1")
        seen: list[Event] = []
        events = keel.events(session)
        try:
            await read_until(events, answers(first.seq), seen)

            port = await stop_edge(stack)
            # Committed while no edge is up: they reach the client as backlog.
            head = await stack.append_inputs(session, 25, prefix="while-down")
            reading = asyncio.ensure_future(read_until(events, has_seq(head), seen))

            async def retrying() -> bool | None:
                # After the drain's wait the iterator finds no edge and backs off.
                if reading.done():
                    reading.result()
                return True if any("event stream lost" in line for line in said()) else None

            await eventually(retrying, "the iterator to find the edge gone", 30)
            await start_edge(stack, port)
            await reading

            after = await keel.send_input(session, "after the restart", request_id="restart-2")
            last = await read_until(events, answers(after.seq), seen)
        finally:
            await events.aclose()
    assert isinstance(last, Fact)
    assert fact_seqs(seen) == list(range(1, last.seq + 1)), "no gap, no duplicate"
    # The stopping edge said `drain` first.
    assert any("draining" in line for line in said()), said()
    ledger = await stack.facts(session)
    assert [f.kind for f in seen if isinstance(f, Fact)] == [f.kind for f in ledger[: last.seq]]


async def test_the_iterator_gives_up_after_its_deadline_and_says_where_to_resume() -> None:
    nothing_there = f"127.0.0.1:{free_port()}"
    policy = ReconnectPolicy(initial_backoff_s=0.05, max_backoff_s=0.1, give_up_after_s=0.5)
    async with AsyncKeelClient(
        nothing_there, "any-key", options=ClientOptions(reconnect=policy)
    ) as keel:
        with pytest.raises(ReconnectGaveUp) as gave_up:
            await anext(keel.events("s-1", after=41))
    assert gave_up.value.last_seq == 41
    assert "after=41" in str(gave_up.value)
    assert isinstance(gave_up.value.__cause__, keel_client.Unavailable)


def _sync_basics(address: str) -> dict[str, Any]:
    """The blocking client's basics, run on a thread of its own."""
    with KeelClient(address, ADMIN_KEY) as keel:
        # A blocking iterator has no deadline of its own: closing the client
        # ends whatever still waits, so a lost answer fails instead of hanging.
        watchdog = threading.Timer(DEADLINE_S, keel.close)
        watchdog.start()
        try:
            return _sync_calls(keel)
        finally:
            watchdog.cancel()


def _sync_calls(keel: KeelClient) -> dict[str, Any]:
    session = keel.create_session("sync-1")
    seen: list[Event] = []
    with keel.events(session) as events:
        seen.append(next(events))
        sent = keel.send_input(session, "hello from a thread", request_id="sync-r1")
        assert keel.send_input(session, "hello from a thread", request_id="sync-r1").duplicate
        try:
            for event in events:
                seen.append(event)
                if answers(sent.seq)(event):
                    break
        except ClientClosed:
            facts = [(e.seq, e.kind) for e in seen if isinstance(e, Fact)]
            raise AssertionError(f"no answer within {DEADLINE_S}s; facts read: {facts}") from None
    try:
        keel.get_session("no-such-session")
        raise AssertionError("expected SessionNotFound")
    except SessionNotFound as missing:
        assert missing.reason == "SESSION_NOT_FOUND"
    return {
        "session": keel.get_session(session),
        "seqs": fact_seqs(seen),
        "listed": [s.session_id for s in keel.iter_sessions(page_size=1)],
        "context": keel.get_context(session),
        "loadout": keel.get_loadout(),
    }


async def test_closing_the_blocking_client_wakes_a_waiting_iterator(
    stack: Stack, grpc_address: str
) -> None:
    keel = await asyncio.to_thread(KeelClient, grpc_address, ADMIN_KEY)
    session = await asyncio.to_thread(keel.create_session)
    # After the session's first fact nothing comes: next() waits.
    events = keel.events(session, after=1)
    waiting = asyncio.ensure_future(asyncio.to_thread(next, events))
    await asyncio.to_thread(keel.close)
    with pytest.raises(ClientClosed):
        await waiting
    with pytest.raises(ClientClosed):
        await asyncio.to_thread(keel.get_session, session)


async def test_the_blocking_client_does_the_same_basics(
    stack: Stack, runner: RunnerServer, grpc_address: str
) -> None:
    result = await asyncio.to_thread(_sync_basics, grpc_address)
    session: Session = result["session"]
    assert session.session_id == "sync-1" and session.head_seq >= len(result["seqs"])
    assert result["seqs"] == list(range(1, len(result["seqs"]) + 1))
    assert result["listed"] == ["sync-1"]
    assert isinstance(result["context"], Context)
    assert isinstance(result["loadout"], Loadout)


def usage_example() -> str:
    """The example of the package docstring (the README shows it too)."""
    doc = keel_client.__doc__ or ""
    lines = doc.split("::", 1)[1].split("\n`KeelClient`", 1)[0].splitlines()
    return "\n".join(line[4:] for line in lines)


async def test_the_usage_example_in_the_package_docstring_works(
    stack: Stack, runner: RunnerServer, grpc_address: str
) -> None:
    code = usage_example()
    assert "127.0.0.1:8081" in code
    # Run as a user runs it: a script of its own, in its own process.
    script = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code.replace("127.0.0.1:8081", grpc_address),
        env=dict(os.environ, KEEL_API_KEY=ADMIN_KEY),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(script.communicate(), DEADLINE_S)
    finally:
        if script.returncode is None:
            script.kill()
            await script.wait()
    assert script.returncode == 0, err.decode()
    sessions = [s async for s in _iter_sessions(grpc_address)]
    facts = await stack.facts(sessions[0])
    answer = next(f for f in facts if f.kind == "assistant")
    assert "hello" in answer.data["content"][0]["text"]
    assert out.decode() == answer.data["content"][0]["text"] + "\n"


async def _iter_sessions(address: str) -> Any:
    async with AsyncKeelClient(address, ADMIN_KEY) as keel:
        async for summary in keel.iter_sessions():
            yield summary.session_id
