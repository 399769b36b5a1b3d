"""The session event stream over real HTTP: long sessions without a gap,
resume from any cursor, fuzzed disconnects while facts keep committing,
a runner SIGKILLed mid-answer, and `event: drain` (SPEC §3, §7)."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import httpx
import pytest

from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from services.cli.chat_view import SseEvent
from tests.support.edge_stack import ADMIN_KEY, Stack
from tests.support.polling import eventually
from tests.support.sse import SseReader, fact_seqs, parse

BIG = 2000


async def sse_clients(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    match = re.search(r"^keel_edge_sse_clients (\S+)$", text, re.MULTILINE)
    assert match is not None, text
    return float(match.group(1))


async def test_two_thousand_facts_stream_without_a_gap(stack: Stack) -> None:
    session = await stack.new_session()
    head = await stack.append_inputs(session, BIG)
    assert head >= BIG  # plus the session's own first fact(s)

    seen: list[SseEvent] = []
    async with SseReader(stack.http, session) as sse:
        await sse.until(lambda e: e.id == str(head), into=seen)
    assert fact_seqs(seen) == list(range(1, head + 1))
    offset = head - BIG
    for event in seen:
        data = parse(event)
        assert event.event == data["kind"]
        assert data["seq"] == int(event.id or 0)
        assert isinstance(data["timestamp"], int) and isinstance(data["epoch"], int)
        if data["seq"] > offset:
            assert data["kind"] == "input"
            assert data["data"]["requestId"] == f"bulk-{data['seq'] - offset - 1}"

    # The same facts as JSON pages.
    paged: list[int] = []
    after = 0
    while True:
        page = await stack.http.get(
            f"/v1/sessions/{session}/events",
            params={"format": "json", "after": after, "limit": 300},
        )
        assert page.status_code == 200, page.text
        body = page.json()
        assert body["headSeq"] == head
        assert len(body["facts"]) <= 300
        if not body["facts"]:
            assert body["next"] == after
            break
        paged += [f["seq"] for f in body["facts"]]
        assert body["next"] == body["facts"][-1]["seq"]
        after = body["next"]
    assert paged == list(range(1, head + 1))
    # A limit above the maximum page is capped, not refused.
    capped = await stack.http.get(
        f"/v1/sessions/{session}/events", params={"format": "json", "limit": 100000}
    )
    assert len(capped.json()["facts"]) == 1000


async def test_resume_from_random_cursors_starts_at_cursor_plus_one(stack: Stack) -> None:
    session = await stack.new_session()
    head = await stack.append_inputs(session, 300)
    rng = random.Random(1234)
    cursors = [0, head - 1, *rng.sample(range(1, head - 1), 8)]
    for index, cursor in enumerate(cursors):
        how: dict[str, Any] = {"last_event_id": str(cursor)} if index % 2 else {"after": cursor}
        async with SseReader(stack.http, session, **how) as sse:
            first = await sse.next()
            assert first is not None and first.id == str(cursor + 1), (how, first)
            assert parse(first)["seq"] == cursor + 1
    # Last-Event-ID wins over ?after= (a browser's reconnect keeps the URL).
    async with SseReader(stack.http, session, last_event_id="250", after=10) as sse:
        first = await sse.next()
        assert first is not None and first.id == "251"
    # At the head: nothing is replayed, the next committed fact is the first frame.
    async with SseReader(stack.http, session, last_event_id=str(head)) as sse:
        reading = asyncio.create_task(sse.next())
        await stack.post_input(session, "live", "live-1")
        first = await reading
        assert first is not None and first.id == str(head + 1)
        assert parse(first)["data"]["text"] == "live"


async def test_fuzzed_disconnects_while_facts_commit(stack: Stack) -> None:
    """40 forced disconnects at random points, each resumed with the last id
    seen, while a writer keeps committing: every fact exactly once, in order."""
    session = await stack.new_session()
    await stack.append_inputs(session, 50, prefix="before")
    rng = random.Random(20240607)
    writer_rng = random.Random(7)
    stop_writing = asyncio.Event()

    async def writer() -> int:
        from services.ledger.client import FactToAppend

        batch = 0
        # Keeps committing until the readers are done, so a reader waiting
        # for more frames always gets them.
        while not stop_writing.is_set():
            facts = [
                FactToAppend("input", {"text": f"w {batch}.{i}", "requestId": f"w-{batch}-{i}"})
                for i in range(writer_rng.randint(1, 3))
            ]
            await stack.cluster.ledger.append(stack.ledger_id(session), facts)
            batch += 1
        return batch

    received: list[int] = []
    writing = asyncio.create_task(writer())
    try:
        for _ in range(40):
            cursor = str(received[-1]) if received else None
            async with SseReader(stack.http, session, last_event_id=cursor) as sse:
                for _ in range(rng.randint(1, 25)):
                    event = await sse.next()
                    assert event is not None
                    if event.id is not None:
                        received.append(int(event.id))
            # Leaving the block cuts the connection mid-stream.
        stop_writing.set()
        batches = await writing
        assert batches > 0
        head = (await stack.cluster.ledger.get_session(stack.ledger_id(session))).head_seq
        if received[-1] < head:
            async with SseReader(stack.http, session, last_event_id=str(received[-1])) as sse:
                seen: list[SseEvent] = []
                await sse.until(lambda e: e.id == str(head), into=seen)
                received += fact_seqs(seen)
    finally:
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)

    assert received == list(range(1, head + 1)), "a gap or a duplicate across reconnects"

    # Every cut stream was let go: no SSE client (nor its ledger stream) leaks.
    async def released() -> bool | None:
        idle = await sse_clients(stack.http) == 0 and not stack.gateway.fanout.sessions
        return True if idle else None

    await eventually(released, "SSE clients and their ledger fan-outs to be released", 10)


@pytest.mark.slow
async def test_stream_goes_on_across_a_runner_sigkill(stack: Stack) -> None:
    """A runner streaming `/slow 3 …` is SIGKILLed; a new runner takes over.
    A client that stays connected and one that reconnects with Last-Event-ID
    both see every fact once, one final answer, and the new owner's partials."""
    cluster = stack.cluster
    session = await stack.new_session()
    words = "one two three four five six seven eight nine ten eleven twelve"
    doomed = cluster.start_runner()
    await cluster.runner_ready(doomed)

    staying_events: list[SseEvent] = []
    moving_events: list[SseEvent] = []
    input_seq = 0

    def final_answer(event: SseEvent) -> bool:
        return event.event == "assistant" and input_seq in (
            parse(event)["data"].get("inputSeqs") or []
        )

    async with SseReader(stack.http, session) as staying:
        async with SseReader(stack.http, session) as moving:
            posted = await stack.post_input(session, f"/slow 3 {words}", "slow-1")
            assert posted.status_code == 202
            input_seq = posted.json()["seq"]
            # The doomed runner is streaming the answer (partials reach both).
            first_delta = await staying.until(lambda e: e.event == "delta", into=staying_events)
            await moving.until(lambda e: e.event == "delta", into=moving_events)
            doomed.kill()
        # The reconnecting client was cut at the kill; it comes back as soon
        # as a successor serves, while the successor is still answering.
        last_id = fact_seqs(moving_events)[-1]
        successor = cluster.start_runner()
        await cluster.runner_ready(successor)

        async def resume() -> None:
            async with SseReader(stack.http, session, last_event_id=str(last_id)) as resumed:
                # The first fact frame is cursor+1. (When the cursor is the head
                # at connect time, the owner's partials - no id, never facts -
                # may come first: a client at the head sees the live answer.)
                first = await resumed.until(lambda e: e.id is not None, into=moving_events)
                assert first.id == str(last_id + 1), first
                if not final_answer(first):
                    await resumed.until(final_answer, into=moving_events, deadline_s=60)

        await asyncio.gather(
            resume(), staying.until(final_answer, into=staying_events, deadline_s=60)
        )

    await cluster.settled(stack.ledger_id(session))
    facts = await stack.facts(session)
    head = facts[-1].seq
    for events in (staying_events, moving_events):
        seqs = fact_seqs(events)
        assert seqs == list(range(1, seqs[-1] + 1)), "a gap or a duplicate in the stream"
        finals = [e for e in events if final_answer(e)]
        assert len(finals) == 1, "exactly one final answer"
        assert parse(finals[0])["data"]["content"], "the final answer has content"
    assert fact_seqs(staying_events)[-1] <= head
    assert sum(1 for f in facts if f.kind == "assistant") == 1

    # A new epoch began, and the connected client got the new owner's partials:
    # the edge re-attached by itself.
    epochs = [parse(e)["data"] for e in staying_events if e.event == "epoch_started"]
    assert len(epochs) >= 2, [e.event for e in staying_events]
    final = next(parse(e) for e in staying_events if final_answer(e))
    new_generation = final["data"]["generationId"]
    last_epoch = max(i for i, e in enumerate(staying_events) if e.event == "epoch_started")
    assert last_epoch > staying_events.index(first_delta), "no epoch began after the kill"
    new_deltas = [
        parse(e)
        for e in staying_events[last_epoch:]
        if e.event == "delta" and parse(e)["generationId"] == new_generation
    ]
    assert new_deltas, "no partials from the new owner reached the connected client"
    assert "".join(d["text"] for d in new_deltas if d["channel"] == "text").strip()


async def test_drain_tells_sse_clients_to_reconnect_and_inputs_still_commit(
    stack: Stack,
) -> None:
    session = await stack.new_session()
    head = await stack.append_inputs(session, 5)
    # A second edge: where drained clients reconnect.
    other = await EdgeServer(
        stack.cluster.settings,
        EdgeConfig(stack.cluster.ledger_server.target, stack.cluster.kernel_server.target),
    ).start()
    other_http = httpx.AsyncClient(
        base_url=other.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    )
    try:
        seen: list[SseEvent] = []
        async with SseReader(stack.http, session) as sse:
            await sse.until(lambda e: e.id == str(head), into=seen)
            # This edge drains when named (a drain names no edge otherwise).
            drain = await stack.http.post(
                "/v1/runtime/drain",
                json={"mode": "handoff", "deadlineMs": 2000, "runtimeId": stack.gateway.edge_id},
            )
            assert drain.status_code == 202, drain.text
            assert drain.json()["mode"] == "handoff"
            assert drain.json()["edge"] == stack.gateway.edge_id
            event = await sse.until(lambda e: e.event == "drain", into=seen)
            assert parse(event) == {"retry_after_ms": 250}
            assert event.id is None
            # The draining edge ends the stream after `drain`.
            assert await sse.next() is None

        # Inputs are still accepted by the draining edge.
        posted = await stack.post_input(session, "after the drain", "after-drain")
        assert posted.status_code == 202, posted.text
        assert posted.json()["seq"] == head + 1
        assert (await stack.http.get("/readyz")).status_code == 503
        status = (await stack.http.get("/v1/runtime/status")).json()
        edge = next(r for r in status["runtimes"] if r["role"] == "edge")
        assert edge["drainMode"] == "handoff"

        # Reconnected elsewhere with Last-Event-ID: the first frame is cursor+1.
        async with SseReader(other_http, session, last_event_id=str(head)) as sse:
            first = await sse.next()
            assert first is not None and first.id == str(head + 1)
            assert parse(first)["data"]["text"] == "after the drain"

            # EdgeServer.stop() (SIGTERM path) also sends `drain`.
            stopping = asyncio.create_task(other.stop())
            event = await sse.until(lambda e: e.event == "drain")
            assert parse(event) == {"retry_after_ms": 1000}
            await stopping
    finally:
        await other_http.aclose()
        await other.stop()
