"""A long session reads back gap-free via Read and via Subscribe from any cursor."""

from __future__ import annotations

import asyncio
import random

from services.ledger import FactToAppend, LedgerClient

FACTS = 2000


def an_input(i: int) -> FactToAppend:
    return FactToAppend("input", {"text": f"message {i}", "requestId": f"req-{i}"})


async def fill(client: LedgerClient, session_id: str, total: int) -> None:
    """Appends inputs until the stream holds `total` facts (seq 1 is session_created)."""
    next_i = 2
    while next_i <= total:
        batch = [an_input(i) for i in range(next_i, min(next_i + 100, total + 1))]
        results = await client.append(session_id, batch)
        assert [r.seq for r in results] == list(range(next_i, next_i + len(batch)))
        next_i += len(batch)


async def take(client: LedgerClient, session_id: str, after: int, count: int) -> list[int]:
    seqs: list[int] = []
    async for fact in client.subscribe(session_id, after):
        seqs.append(fact.seq)
        if len(seqs) == count:
            break
    return seqs


async def test_2000_facts_read_back_without_gap(client: LedgerClient) -> None:
    assert await client.create_session("long", "tenant-a")
    await fill(client, "long", FACTS)

    facts = await client.read_all("long")
    assert [f.seq for f in facts] == list(range(1, FACTS + 1))
    assert facts[0].kind == "session_created"
    assert facts[0].data == {"tenantId": "tenant-a"}
    assert all(f.kind == "input" for f in facts[1:])
    assert facts[-1].data["requestId"] == f"req-{FACTS}"

    rng = random.Random(7)
    for cursor in [0, 1, 999, FACTS - 1, *rng.sample(range(FACTS), 5)]:
        wanted = FACTS - cursor
        seqs = await take(client, "long", cursor, wanted)
        assert seqs == list(range(cursor + 1, FACTS + 1)), f"cursor {cursor}"


async def test_subscribe_gives_backlog_then_live_in_order(client: LedgerClient) -> None:
    await client.create_session("live", "tenant-a")
    await fill(client, "live", 50)
    subscriber = asyncio.create_task(take(client, "live", 10, 90))
    # Live appends race with the backlog being streamed; order must hold.
    for i in range(51, 101):
        await client.append_one("live", "input", {"text": "x", "requestId": f"live-{i}"})
    assert await asyncio.wait_for(subscriber, 30) == list(range(11, 101))


async def test_concurrent_writers_of_one_session_leave_no_gap(client: LedgerClient) -> None:
    await client.create_session("busy", "tenant-a")

    async def writer(w: int) -> list[int]:
        seqs = []
        for i in range(25):
            appended = await client.append_one(
                "busy", "input", {"text": "x", "requestId": f"w{w}-{i}"}
            )
            seqs.append(appended.seq)
        return seqs

    results = await asyncio.gather(*(writer(w) for w in range(8)))
    every = sorted(seq for seqs in results for seq in seqs)
    assert every == list(range(2, 2 + 8 * 25))
    head = await client.get_session("busy")
    assert head.head_seq == 1 + 8 * 25
    assert head.owed_input_seqs == tuple(range(2, 2 + 8 * 25))
