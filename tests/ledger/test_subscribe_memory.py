"""A subscriber of a live session gets this ledger's own commits from memory.

The writer hands what it committed to the waker; a subscriber at the head
takes it from there instead of reading the database after every commit.
What it receives must be exactly what a read returns; a commit this
process did not make (another ledger on the same PostgreSQL) still reaches
it promptly, read from the database.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer
from services.ledger.facts import CommittedFact
from tests.support.polling import eventually

LIVE = 60


class ReadCounter:
    """Counts the database reads a ledger's subscribers make."""

    def __init__(self, server: LedgerServer) -> None:
        assert server.store is not None
        store = server.store
        original = store.read
        self.calls = 0

        def counted(*args: Any) -> list[CommittedFact]:
            self.calls += 1
            return original(*args)

        store.read = counted  # type: ignore[method-assign]


async def follow(client: LedgerClient, session_id: str, count: int) -> list[CommittedFact]:
    seen: list[CommittedFact] = []
    async for fact in client.subscribe(session_id, 0):
        seen.append(fact)
        if len(seen) == count:
            break
    return seen


async def test_live_facts_come_from_memory_equal_to_a_read(
    ledger: LedgerServer, client: LedgerClient
) -> None:
    await client.create_session("mem", "tenant-a")
    reads = ReadCounter(ledger)
    follower = asyncio.create_task(follow(client, "mem", 1 + LIVE))
    await eventually(lambda: reads.calls >= 1, "the subscriber's first read")
    for i in range(LIVE):
        # One at a time, each committed before the next: the subscriber is
        # woken once per commit, at the head every time.
        await client.append_one("mem", "input", {"text": f"é {i} 🚢", "requestId": f"r{i}"})
    seen = await asyncio.wait_for(follower, 20)

    assert [f.seq for f in seen] == list(range(1, LIVE + 2))
    assert seen == await client.read_all("mem")
    # The first read found the creation fact; everything live came from
    # memory (a safety poll on a slow machine may add a read or two).
    assert reads.calls < 1 + LIVE // 2, f"{reads.calls} reads for {LIVE} live facts"


async def test_a_window_the_subscriber_fell_behind_is_read(
    ledger: LedgerServer, client: LedgerClient
) -> None:
    await client.create_session("behind", "tenant-a")
    # Written before anyone follows: memory never had it.
    for i in range(30):
        await client.append_one("behind", "input", {"text": "x", "requestId": f"b{i}"})
    seen = await asyncio.wait_for(follow(client, "behind", 31), 20)
    assert [f.seq for f in seen] == list(range(1, 32))


@pytest.fixture
async def second_ledger(pg_settings: Settings) -> AsyncIterator[tuple[LedgerServer, LedgerServer]]:
    first = await LedgerServer(pg_settings).start()
    second = await LedgerServer(pg_settings).start()
    yield first, second
    await second.stop(grace=0.5)
    await first.stop(grace=0.5)


async def test_another_ledgers_commits_still_reach_a_subscriber(
    second_ledger: tuple[LedgerServer, LedgerServer],
) -> None:
    writer_side, reader_side = second_ledger
    assert reader_side.store is not None
    async with (
        LedgerClient(writer_side.target, writer_side.settings) as writer,
        LedgerClient(reader_side.target, reader_side.settings) as reader,
    ):
        await writer.create_session("across", "tenant-a")
        follower = asyncio.create_task(follow(reader, "across", 21))
        for i in range(10):
            await writer.append_one("across", "input", {"text": "a", "requestId": f"w{i}"})
        # Both ledgers write the same session: each one's subscribers mix
        # memory (own commits) and reads (the other's), without a gap.
        for i in range(10):
            await reader.append_one("across", "input", {"text": "b", "requestId": f"v{i}"})
        seen = await asyncio.wait_for(follower, 20)
        assert [f.seq for f in seen] == list(range(1, 22))
        assert seen == await reader.read_all("across")
