"""Two ledger processes on one PostgreSQL serve one set of streams."""

from __future__ import annotations

import asyncio

from services.common.config import Settings
from services.ledger import LedgerClient
from services.ledger.store import LedgerStore
from tests.support.replicas import start_at_once


async def test_subscriber_on_one_sees_appends_through_the_other(
    two_ledgers: tuple[str, str], pg_settings: Settings
) -> None:
    first, second = two_ledgers
    settings = pg_settings
    async with LedgerClient(first, settings) as a, LedgerClient(second, settings) as b:
        await a.create_session("shared", "t")
        await a.append_one("shared", "input", {"text": "via a", "requestId": "r0"})

        seen: list[tuple[int, str]] = []

        async def follow() -> None:
            async for fact in a.subscribe("shared", 0):
                seen.append((fact.seq, fact.data.get("requestId", "")))
                if fact.seq == 12:
                    return

        follower = asyncio.create_task(follow())
        for i in range(1, 11):
            appended = await b.append_one(
                "shared", "input", {"text": "via b", "requestId": f"r{i}"}
            )
            assert appended.seq == 2 + i
        await asyncio.wait_for(follower, 30)
        assert [s for s, _ in seen] == list(range(1, 13))
        assert seen[-1][1] == "r10"
        # Both processes decide on the same state: dedup holds across them.
        again = await a.append_one("shared", "input", {"text": "via b", "requestId": "r5"})
        assert again.duplicate and again.seq == 7
        assert (await a.get_session("shared")).head_seq == 12


def test_schema_creation_is_safe_with_replicas_starting_at_once(pg_settings: Settings) -> None:
    stores, errors = start_at_once(lambda: LedgerStore(pg_settings))
    try:
        assert errors == []
        assert stores[0].create_session("after-race", "t")
        assert not stores[1].create_session("after-race", "t")
    finally:
        for store in stores:
            store.close()
