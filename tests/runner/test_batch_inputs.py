"""Inputs answered together are each acted on, by a real runner process.

Inputs committed while an attempt runs are above its watermark; the next
attempt reads them all and answers them with one request. Every command in
that request must run, not only the last one's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.ledger.client import FactToAppend
from services.runner.tool_state import counter_store
from tests.support.cluster import Cluster
from tests.support.ledger_invariants import assert_recovered
from tests.support.polling import eventually

pytestmark = pytest.mark.slow


async def test_inputs_committed_while_an_answer_streams_are_each_acted_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    recorded = tmp_path / "requests.jsonl"
    runner = cluster.start_runner(KEEL_RECORD_REQUESTS=str(recorded))
    await cluster.runner_ready(runner)
    await cluster.new_session("batch")
    first = await cluster.send("batch", "/slow 2 working on it", "r0")

    async def running() -> bool | None:
        facts = await cluster.facts("batch")
        return True if any(f.kind == "epoch_started" for f in facts) else None

    await eventually(running, "the first attempt to start")
    texts = ["hello there", '/tool counter {"key":"batch-a"}', '/tool counter {"key":"batch-b"}']
    # One append: they are committed together, so one request shows them all.
    appended = await cluster.ledger.append(
        "batch",
        [
            FactToAppend("input", {"text": text, "requestId": f"r{i + 1}"})
            for i, text in enumerate(texts)
        ],
    )
    seqs = [a.seq for a in appended]
    await cluster.kernel.enqueue("batch", "default", input_seq=seqs[-1])
    await cluster.settled("batch")

    counters = counter_store(cluster.settings)
    assert counters.executions("batch-a") == 1
    assert counters.executions("batch-b") == 1

    facts = await cluster.facts("batch")
    assert_recovered(facts)
    finals = {
        tuple(f.data["inputSeqs"]): f
        for f in facts
        if f.kind == "assistant" and "inputSeqs" in f.data
    }
    assert set(finals) == {(first,), tuple(seqs)}
    answer = finals[tuple(seqs)].data["content"][0]["text"].splitlines()
    assert answer[0] == "You said: hello there"
    assert len([line for line in answer if line.startswith("Tool counter returned:")]) == 2

    # Every recorded request names the answer it produced, and every epoch
    # the loadout revision it pinned.
    requests = [json.loads(line) for line in recorded.read_text().splitlines()]
    answers = [f.data["generationId"] for f in facts if f.kind == "assistant"]
    assert [r["generationId"] for r in requests] == answers
    calling = requests[answers.index(finals[tuple(seqs)].data["generationId"]) - 1]
    assert [m["content"] for m in calling["messages"][-3:]] == texts
    revision = (await cluster.kernel.get_loadout("default")).revision
    epochs = [f for f in facts if f.kind == "epoch_started"]
    assert epochs and all(f.data["loadoutRevision"] == revision for f in epochs)
