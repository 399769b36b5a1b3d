"""Compaction inside real runs: real runner processes, the scripted model, PostgreSQL.

The runner records every request the scripted model receives
(KEEL_RECORD_REQUESTS), so the tests compare what the model was really shown
with what the compaction service rebuilds from the ledger alone.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from compaction.client import CompactionClient
from services.common.config import Settings
from services.ledger import CommittedFact
from tests.support.cluster import Cluster, running_cluster
from tests.support.databases import settings_env
from tests.support.ledger_invariants import assert_recovered
from tests.support.polling import eventually
from tests.support.processes import ChildProcess

MESSAGE_KINDS = ("input", "assistant", "tool_result")


@pytest.fixture
async def cluster(pg_settings: Settings) -> AsyncIterator[Cluster]:
    async with running_cluster(pg_settings, backoff_base_ms=100, max_attempts=3) as running:
        await running.kernel.create_tenant("default")
        yield running


async def use_loadout(cluster: Cluster, window: int, **compaction: Any) -> None:
    await cluster.kernel.put_loadout(
        "default",
        {
            "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": window},
            "compaction": {"enabled": True, **compaction},
        },
    )


async def ask(cluster: Cluster, session: str, texts: list[str]) -> None:
    """Each text as its own turn: sent once the previous one is answered."""
    for text in texts:
        await cluster.send(session, text, uuid.uuid4().hex)
        await cluster.settled(session, deadline_s=30)


def recorded(path: Path, purpose: str) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["purpose"] == purpose]


def of_kind(facts: list[CommittedFact], kind: str) -> list[CommittedFact]:
    return [f for f in facts if f.kind == kind]


def assert_compactions_cover_everything(facts: list[CommittedFact]) -> None:
    """Each compaction summarizes from where the previous one kept up to just
    before its own first kept message: no message is ever dropped unseen."""
    messages = [f.seq for f in facts if f.kind in MESSAGE_KINDS]
    kept_from = messages[0]
    for fact in of_kind(facts, "compaction"):
        first, last = fact.data["summarized"]
        first_kept = fact.data["firstKept"]
        earlier = [seq for seq in messages if seq < fact.seq]
        assert first_kept in earlier, f"compaction {fact.seq} keeps from a non-message"
        assert first == kept_from, f"compaction {fact.seq} skips {kept_from}..{first}"
        assert last == max(seq for seq in earlier if seq < first_kept)
        assert fact.data["tokensAfter"] < fact.data["tokensBefore"]
        kept_from = first_kept


@pytest.mark.slow
async def test_a_long_session_compacts_and_every_request_is_rebuilt_exactly(
    cluster: Cluster, tmp_path: Path
) -> None:
    await use_loadout(cluster, 2400, keepRecentTokens=700, reserveTokens=600)
    record = tmp_path / "requests.jsonl"
    env = {**settings_env(cluster.settings), "KEEL_RECORD_REQUESTS": str(record)}
    # The compaction service as its own process (the runner calls it by address).
    service = ChildProcess.python(
        "-m",
        "compaction",
        "--ledger",
        cluster.ledger_server.target,
        "--kernel",
        cluster.kernel_server.target,
        "--address",
        "127.0.0.1:0",
        env=env,
    )
    try:
        address = await asyncio.to_thread(service.wait_listening)
        runner = cluster.start_runner(
            KEEL_RECORD_REQUESTS=str(record), KEEL_COMPACTION_ADDRESS=address
        )
        await cluster.runner_ready(runner)
        await cluster.new_session("long")
        await ask(cluster, "long", ["/long 300"] * 16)

        facts = await cluster.facts("long")
        assert_recovered(facts)
        compactions = of_kind(facts, "compaction")
        assert len(compactions) >= 3
        assert_compactions_cover_everything(facts)
        assert len(recorded(record, "summary")) >= len(compactions)

        # What the model was shown for each answer is exactly what the ledger
        # says a request built at that answer's context head presents.
        answers = of_kind(facts, "assistant")
        shown = [
            {"system": r["system"], "messages": r["messages"]} for r in recorded(record, "turn")
        ]
        async with CompactionClient(address, cluster.settings) as client:
            rebuilt = []
            for answer in answers:
                head = int(answer.data["generationId"].removeprefix("gen-"))
                context = await client.get_context("long", head)
                rebuilt.append(
                    {"system": context.system_prompt, "messages": list(context.messages)}
                )
            assert rebuilt == shown
            # At the head: the latest summary, then every message from its first kept one.
            latest = compactions[-1]
            now = await client.get_context("long")
            kept = [
                f for f in facts if f.kind in MESSAGE_KINDS and f.seq >= latest.data["firstKept"]
            ]
            assert now.compaction_seq == latest.seq
            assert latest.data["summary"] in now.messages[0]["content"]
            assert len(now.messages) == 1 + len(kept)
        assert service.terminate() == 0
    finally:
        service.kill()


@pytest.mark.slow
async def test_a_crash_mid_summary_commits_nothing_and_the_successor_compacts(
    cluster: Cluster,
) -> None:
    await use_loadout(cluster, 2400, keepRecentTokens=700, reserveTokens=600)
    # Embedded compaction: the summary is written inside the runner process.
    doomed = cluster.start_runner(KEEL_FAULT_POINT="mid_summary")
    await cluster.runner_ready(doomed)
    await cluster.new_session("crash")

    async def frozen_or_settled(session: str) -> str | None:
        if "FAULT mid_summary" in doomed.lines:
            return "frozen"
        view = await cluster.ledger.get_session(session)
        lease = await cluster.kernel.get_lease(session)
        idle = not view.owed_input_seqs and lease.lease is None and not lease.queued
        return "settled" if idle else None

    for index in range(12):
        await cluster.send("crash", "/long 300", f"crash-{index}")
        outcome = await eventually(lambda: frozen_or_settled("crash"), "a turn or the fault", 30)
        if outcome == "frozen":
            break
    else:
        pytest.fail("the session never compacted")
    doomed.kill()
    facts = await cluster.facts("crash")
    assert of_kind(facts, "compaction") == []
    doomed_epoch = max(f.data["epoch"] for f in of_kind(facts, "epoch_started"))

    successor = cluster.start_runner()
    await cluster.runner_ready(successor)
    await cluster.settled("crash")
    facts = await cluster.facts("crash")
    assert_recovered(facts)
    [compaction] = of_kind(facts, "compaction")
    assert compaction.epoch > doomed_epoch
    assert_compactions_cover_everything(facts)
    assert of_kind(facts, "attempt_failed") == []


async def test_an_overflow_compacts_and_retries_once(cluster: Cluster, tmp_path: Path) -> None:
    # A threshold no context reaches: only the provider's overflow compacts.
    await use_loadout(cluster, 2000, threshold=1_000_000, keepRecentTokens=600, reserveTokens=600)
    record = tmp_path / "requests.jsonl"
    runner = cluster.start_runner(KEEL_RECORD_REQUESTS=str(record))
    await cluster.runner_ready(runner)

    # The fifth request (about 2022 tokens) overflows the 2000-token window.
    await cluster.new_session("fits")
    await ask(cluster, "fits", ["/long 500"] * 5)
    facts = await cluster.facts("fits")
    assert_recovered(facts)
    [compaction] = of_kind(facts, "compaction")
    assert compaction.data["reason"] == "overflow"
    final = of_kind(facts, "assistant")[-1]
    assert final.seq > compaction.seq and final.data["inputSeqs"]
    assert of_kind(facts, "attempt_failed") == []
    turns = recorded(record, "turn")
    assert len(turns) == 6, "one request overflowed, then one retry"

    # An input larger than the window overflows again after the compaction:
    # the attempt fails and says why, instead of compacting in a loop.
    await cluster.new_session("huge")
    await ask(cluster, "huge", ["/long 300", "/long 300"])
    await cluster.send("huge", "word " * 1680, "huge-input")

    async def parked() -> list[CommittedFact] | None:
        facts = await cluster.facts("huge")
        return facts if of_kind(facts, "session_parked") else None

    facts = await eventually(parked, "the session to be parked", 30)
    failures = of_kind(facts, "attempt_failed")
    assert "still overflows the model's window after compaction" in failures[0].data["error"]
    assert all("overflow" in f.data["error"] for f in failures)
    [compaction] = of_kind(facts, "compaction")
    assert compaction.data["reason"] == "overflow" and compaction.seq < failures[0].seq
    assert_compactions_cover_everything(facts)


async def test_three_failed_summaries_suspend_compaction(cluster: Cluster, tmp_path: Path) -> None:
    await use_loadout(cluster, 100_000, threshold=300, keepRecentTokens=100, reserveTokens=1000)
    record = tmp_path / "requests.jsonl"
    runner = cluster.start_runner(KEEL_RECORD_REQUESTS=str(record))
    await cluster.runner_ready(runner)
    await cluster.new_session("stuck")
    # The first input makes every summary of this session fail; each later
    # /long turn is over the threshold.
    await ask(cluster, "stuck", ["/failsummary remember this", *["/long 200"] * 5])
    facts = await cluster.facts("stuck")
    failed = of_kind(facts, "compaction_failed")
    assert [f.data["consecutive"] for f in failed] == [1, 2, 3]
    assert [f.data["suspended"] for f in failed] == [False, False, True]
    assert all("scripted summary failure" in f.data["error"] for f in failed)
    summaries = len(recorded(record, "summary"))
    assert summaries >= 3

    # Suspended: more turns over the threshold, and nobody tries again.
    await ask(cluster, "stuck", ["/long 200"] * 3)
    facts = await cluster.facts("stuck")
    assert_recovered(facts)
    assert len(recorded(record, "summary")) == summaries
    assert len(of_kind(facts, "compaction_failed")) == 3
    assert of_kind(facts, "compaction") == []
    # Failed compactions never failed the attempts: every input got its answer.
    assert of_kind(facts, "attempt_failed") == []
    assert len(of_kind(facts, "assistant")) == 9

    # Something changed (a new loadout revision): compaction is tried again.
    await use_loadout(cluster, 100_000, threshold=300, keepRecentTokens=100, reserveTokens=1000)
    await ask(cluster, "stuck", ["/long 200"])
    failed = of_kind(await cluster.facts("stuck"), "compaction_failed")
    assert [f.data["consecutive"] for f in failed] == [1, 2, 3, 1]
    assert failed[-1].data["loadoutRevision"] > failed[0].data["loadoutRevision"]
