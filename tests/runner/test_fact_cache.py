"""The runner's memory of sessions between attempts: what it reads again,
and that what it hands an attempt is exactly the ledger's facts."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer
from services.ledger.client import FactToAppend
from services.ledger.facts import CommittedFact
from services.runner.config import RunnerConfig
from services.runner.factcache import FactCache, SessionHistory
from services.runner.server import RunnerServer
from tests.support.cluster import start_cluster, stop_cluster
from tests.support.polling import eventually


class CountingLedger(LedgerClient):
    """A real ledger client that remembers from where each read started."""

    def __init__(self, target: str, settings: Settings) -> None:
        super().__init__(target, settings)
        self.reads_after: list[int] = []

    async def read(
        self, session_id: str, after_seq: int = 0, limit: int = 1000
    ) -> tuple[list[CommittedFact], int]:
        self.reads_after.append(after_seq)
        return await super().read(session_id, after_seq, limit)


@pytest.fixture
async def ledger(settings: Settings) -> AsyncIterator[CountingLedger]:
    server = await LedgerServer(settings).start()
    client = CountingLedger(server.target, settings)
    try:
        yield client
    finally:
        await client.close()
        await server.stop(grace=0.5)


def _content(fact: CommittedFact) -> tuple[object, ...]:
    # An attempt's own commits are kept as it wrote them, with its own clock
    # reading instead of the ledger's: the runner never reads timestamps.
    return (fact.session_id, fact.seq, fact.kind, fact.data, fact.epoch)


async def _inputs(ledger: LedgerClient, session_id: str, *texts: str) -> None:
    await ledger.append(
        session_id, [FactToAppend("input", {"text": t, "requestId": t}) for t in texts]
    )


async def test_a_later_attempt_reads_only_what_came_after(ledger: CountingLedger) -> None:
    await ledger.create_session("s-cache", "tenant-a")
    await _inputs(ledger, "s-cache", "one", "two", "three")
    cache = FactCache(ledger, max_facts=100)

    first = await cache.load("s-cache")
    assert first.facts == await ledger.read_all("s-cache")
    tail = first.facts[-1].seq
    cache.keep("s-cache", first)
    await _inputs(ledger, "s-cache", "four", "five")

    ledger.reads_after.clear()
    second = await cache.load("s-cache")
    assert ledger.reads_after == [tail]
    assert second.facts == await ledger.read_all("s-cache")
    texts = [f.data["text"] for f in second.facts if f.kind == "input"]
    assert texts == ["one", "two", "three", "four", "five"]


async def test_only_a_complete_prefix_is_kept(ledger: CountingLedger) -> None:
    await ledger.create_session("s-gap", "tenant-a")
    await _inputs(ledger, "s-gap", "one", "two", "three")
    cache = FactCache(ledger, max_facts=100)
    facts = await ledger.read_all("s-gap")

    cache.keep("s-gap", SessionHistory(facts[1:]))  # seq 1 missing
    assert cache.size == 0
    ledger.reads_after.clear()
    assert (await cache.load("s-gap")).facts == facts
    assert ledger.reads_after == [0]


async def test_least_recently_used_sessions_go_first(ledger: CountingLedger) -> None:
    cache = FactCache(ledger, max_facts=7)
    heads = []
    for session_id in ("s-old", "s-new"):
        await ledger.create_session(session_id, "tenant-a")
        await _inputs(ledger, session_id, "a", "b", "c")
        history = await cache.load(session_id)
        heads.append(len(history.facts))
        cache.keep(session_id, history)
    assert heads[0] == heads[1] > 7 // 2
    assert cache.size == heads[1]  # s-old made room for s-new

    ledger.reads_after.clear()
    await cache.load("s-new")
    await cache.load("s-old")
    assert ledger.reads_after == [heads[1], 0]


async def test_the_runtime_keeps_what_its_attempts_saw(pg_settings: Settings) -> None:
    """Wired in: after each attempt the runtime holds the session's facts,
    exactly as the ledger has them, for the next attempt to start from."""
    cluster = await start_cluster(pg_settings)
    runner = await RunnerServer(
        pg_settings, RunnerConfig(cluster.ledger_server.target, cluster.kernel_server.target)
    ).start()
    try:
        assert runner.runtime is not None
        cache = runner.runtime.fact_cache
        await cluster.new_session("s-kept")
        for turn in range(2):
            await cluster.send("s-kept", f"question {turn}", f"r{turn}")
            await cluster.settled("s-kept")
            facts = await cluster.facts("s-kept")

            async def kept(expected: int = len(facts)) -> bool | None:
                return True if cache.size == expected else None

            await eventually(kept, "the attempt's facts to be kept")
            history = await cache.load("s-kept")  # reads nothing new
            assert [_content(f) for f in history.facts] == [_content(f) for f in facts]
            assert history.parsed, "parsed context messages travel with the facts"
            cache.keep("s-kept", history)
    finally:
        await runner.stop(grace=0.2)
        await stop_cluster(cluster)
