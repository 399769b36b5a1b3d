"""A long session read from the start, several pages at once: exactly the
ledger's facts, in order, including what is appended while it is read."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer
from services.ledger.client import FactToAppend
from services.ledger.facts import MAX_FACTS_PER_APPEND, MAX_READ_LIMIT, CommittedFact
from services.runner.factcache import FactCache

SESSION = "s-long"


class AppendingLedger(LedgerClient):
    """A real client that, once, appends to the session as a later page's
    read begins (a client's input landing while a successor reads)."""

    def __init__(self, target: str, settings: Settings) -> None:
        super().__init__(target, settings)
        self.reads_after: list[int] = []
        self.append_during_read_after: int | None = None
        self.in_flight = self.most_in_flight = 0

    async def read(
        self, session_id: str, after_seq: int = 0, limit: int = 0
    ) -> tuple[list[CommittedFact], int]:
        self.reads_after.append(after_seq)
        if after_seq == self.append_during_read_after:
            self.append_during_read_after = None
            await _inputs(self, "late-1", "late-2")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await super().read(session_id, after_seq, limit)
        finally:
            self.in_flight -= 1


async def _inputs(ledger: LedgerClient, *texts: str) -> None:
    await ledger.append(
        SESSION, [FactToAppend("input", {"text": f"{t} ✓", "requestId": t}) for t in texts]
    )


@pytest.fixture
async def ledger(settings: Settings) -> AsyncIterator[AppendingLedger]:
    server = await LedgerServer(settings).start()
    client = AppendingLedger(server.target, settings)
    try:
        await client.create_session(SESSION, "tenant-a")
        written = 1
        while written < 3 * MAX_READ_LIMIT + 123:
            batch = [f"r{written + i}" for i in range(MAX_FACTS_PER_APPEND)]
            await _inputs(client, *batch)
            written += len(batch)
        yield client
    finally:
        await client.close()
        await server.stop(grace=0.5)


async def test_a_cold_load_reads_the_pages_at_once_and_misses_nothing(
    ledger: AppendingLedger,
) -> None:
    expected = await ledger.read_all(SESSION)
    ledger.reads_after.clear()
    history = await FactCache(ledger, max_facts=100_000).load(SESSION)
    assert history.facts == expected
    assert [f.seq for f in history.facts] == list(range(1, len(expected) + 1))
    assert sorted(ledger.reads_after) == list(range(0, len(expected), MAX_READ_LIMIT))
    assert ledger.most_in_flight > 1, "the pages after the first were read at once"


async def test_a_load_from_a_kept_prefix_pages_from_its_tail(ledger: AppendingLedger) -> None:
    expected = await ledger.read_all(SESSION)
    cache = FactCache(ledger, max_facts=100_000)
    prefix = await cache.load(SESSION)
    prefix.facts[:] = prefix.facts[:777]
    cache.keep(SESSION, prefix)
    history = await cache.load(SESSION)
    assert history.facts == expected


async def test_facts_appended_while_the_pages_are_read_are_read_too(
    ledger: AppendingLedger,
) -> None:
    head = len(await ledger.read_all(SESSION))
    ledger.append_during_read_after = 2 * MAX_READ_LIMIT  # the third page
    history = await FactCache(ledger, max_facts=100_000).load(SESSION)
    assert history.facts == await ledger.read_all(SESSION)
    assert [f.seq for f in history.facts] == list(range(1, head + 3))
    assert [f.data["requestId"] for f in history.facts[-2:]] == ["late-1", "late-2"]
