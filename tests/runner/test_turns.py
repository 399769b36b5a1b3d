"""The turn loop against real runner processes and the scripted model."""

from __future__ import annotations

import os
import signal

import pytest

from services.common.config import Settings
from services.runner.tool_state import counter_store
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.ledger_invariants import assert_recovered
from tests.support.polling import eventually


async def test_an_input_is_answered_once(cluster: Cluster) -> None:
    runner = cluster.start_runner()
    await cluster.runner_ready(runner)
    await cluster.new_session("s1")
    seq = await cluster.send("s1", "hello there", "r1")
    await cluster.settled("s1")
    facts = await cluster.facts("s1")
    assert [f.kind for f in facts] == ["session_created", "input", "epoch_started", "assistant"]
    answer = facts[-1]
    assert answer.data["inputSeqs"] == [seq]
    assert answer.data["generationId"] == f"gen-{seq}"
    assert "hello there" in answer.data["content"][0]["text"]
    assert facts[2].data["watermark"] == seq
    assert_recovered(facts)


async def test_tool_calls_get_exactly_one_result_each(cluster: Cluster) -> None:
    runner = cluster.start_runner()
    await cluster.runner_ready(runner)
    await cluster.new_session("tools")
    await cluster.send("tools", '/tool counter {"key": "t1"} | clock {}', "r1")
    await cluster.settled("tools")
    facts = await cluster.facts("tools")
    kinds = [f.kind for f in facts]
    assert kinds.count("tool_result") == 2
    final = facts[-1]
    assert final.kind == "assistant" and final.data["inputSeqs"] == [2]
    assert '"value": 1' in final.data["content"][0]["text"]
    assert_recovered(facts)
    counter = counter_store(cluster.settings)
    assert counter.value("t1") == 1


@pytest.mark.slow
@pytest.mark.parametrize("sticky_ms", ["30000", "0"], ids=["sticky", "cold"])
async def test_inputs_arriving_mid_attempt_are_answered_next(
    cluster: Cluster, sticky_ms: str
) -> None:
    runner = cluster.start_runner(KEEL_STICKY_MS=sticky_ms)
    await cluster.runner_ready(runner)
    await cluster.new_session("mid")
    first = await cluster.send("mid", "/slow 1 first answer", "r1")

    async def started() -> bool | None:
        return True if any(f.kind == "epoch_started" for f in await cluster.facts("mid")) else None

    await eventually(started, "the first attempt to start")
    second = await cluster.send("mid", "second question", "r2")
    await cluster.settled("mid")
    facts = await cluster.facts("mid")
    assert_recovered(facts)
    answers = {tuple(f.data["inputSeqs"]): f for f in facts if f.kind == "assistant"}
    assert (first,) in answers and (second,) in answers
    # The second input was above the first attempt's watermark: a turn of its
    # own. A runner keeping the session runs it under the same lease (its
    # Finish found the input and held the lease on); one that keeps nothing
    # claims it again, with a new epoch.
    starts = [f.data["epoch"] for f in facts if f.kind == "epoch_started"]
    assert starts == ([1] if sticky_ms != "0" else [1, 2])
    assert answers[(second,)].epoch == starts[-1]


async def test_provider_failure_is_retried_then_answered(cluster: Cluster) -> None:
    runner = cluster.start_runner()
    await cluster.runner_ready(runner)
    await cluster.new_session("flaky")
    seq = await cluster.send("flaky", "/fail 1 after one failure", "r1")
    await cluster.settled("flaky")
    facts = await cluster.facts("flaky")
    failures = [f for f in facts if f.kind == "attempt_failed"]
    assert len(failures) == 1 and failures[0].data["attempt"] == 1
    assert facts[-1].kind == "assistant" and facts[-1].data["inputSeqs"] == [seq]
    assert_recovered(facts)


async def test_a_failing_session_is_parked_after_n_attempts(cluster: Cluster) -> None:
    runner = cluster.start_runner()
    await cluster.runner_ready(runner)
    await cluster.new_session("doomed")
    # Retryable every time (a bare "/fail" is not: it parks at once).
    seq = await cluster.send("doomed", "/fail 99 never answered", "r1")

    async def parked() -> bool | None:
        view = await cluster.ledger.get_session("doomed")
        return True if view.parked else None

    await eventually(parked, "the session to be parked")
    facts = await cluster.facts("doomed")
    assert len([f for f in facts if f.kind == "attempt_failed"]) == 3
    assert facts[-1].kind == "session_parked"
    view = await cluster.ledger.get_session("doomed")
    assert view.owed_input_seqs == (seq,)  # still owed, visibly parked
    assert not view.owes_work


async def test_cancel_stops_a_running_generation(cluster: Cluster) -> None:
    runner = cluster.start_runner()
    await cluster.runner_ready(runner)
    await cluster.new_session("cancel")
    seq = await cluster.send("cancel", "/slow 120 this would take two minutes", "r1")

    async def running() -> bool | None:
        facts = await cluster.facts("cancel")
        return True if any(f.kind == "epoch_started" for f in facts) else None

    await eventually(running, "the generation to start")
    await cluster.ledger.append_one("cancel", "cancelled", {"reason": "user"})
    await cluster.settled("cancel", deadline_s=30)
    facts = await cluster.facts("cancel")
    settle = facts[-1]
    assert settle.kind == "assistant" and settle.data["stopReason"] == "cancelled"
    assert settle.data["inputSeqs"] == [seq]
    assert_recovered(facts)


@pytest.mark.slow
async def test_a_paused_stale_owner_gets_no_write_accepted(pg_settings: Settings) -> None:
    settings = pg_settings.with_overrides(lease_ms=1500)
    cluster = await start_cluster(settings)
    try:
        stale = cluster.start_runner()
        await cluster.runner_ready(stale)
        await cluster.new_session("paused")
        await cluster.send("paused", "/slow 3 written slowly by the first owner", "r1")

        async def owner_epoch() -> int | None:
            facts = await cluster.facts("paused")
            starts = [f.data["epoch"] for f in facts if f.kind == "epoch_started"]
            return starts[-1] if starts else None

        first_epoch = await eventually(owner_epoch, "the first owner to start")
        os.kill(stale.pid, signal.SIGSTOP)
        try:
            successor = cluster.start_runner()
            await cluster.runner_ready(successor)
            await cluster.settled("paused", deadline_s=60)
        finally:
            os.kill(stale.pid, signal.SIGCONT)
        # Let the stale owner wake up and try to write; then check it failed.
        await stale.line(lambda line: "fenced" in line or "lost" in line, deadline_s=30)
        facts = await cluster.facts("paused")
        assert_recovered(facts)
        assert all(f.epoch != first_epoch for f in facts if f.kind == "assistant")
    finally:
        await stop_cluster(cluster)
