"""What the model sees, over random interleavings, end to end.

Inputs arrive before, during and after answers (slow answers leave room for
inputs mid-attempt), with tool calls, cancels and compactions, through the
real HTTP API, a real runner and the compaction service. The offline model
records every request it is sent. Each one must be a well-formed
conversation, each answer must come right after the inputs it consumed, and
`GET /context?at=<head>` must show exactly what was sent for that head.
Fixed seeds: a failing schedule replays.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from services.ledger import CommittedFact
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer
from tests.support.edge_stack import Stack
from tests.support.polling import eventually
from tests.support.transcript_checks import check_well_formed, is_summary, trailing_inputs

OPS = ("text", "text", "slow", "slow", "tool", "cancel", "settle", "long", "long")


async def start_compacting_runner(stack: Stack) -> RunnerServer:
    cluster = stack.cluster
    runner = await RunnerServer(
        cluster.settings,
        RunnerConfig(
            cluster.ledger_server.target,
            cluster.kernel_server.target,
            compaction_target=stack.compaction.target,
        ),
    ).start()
    stack.runners.append(runner)
    return runner


async def settled(stack: Stack, session_id: str) -> None:
    async def idle() -> bool | None:
        body = (await stack.http.get(f"/v1/sessions/{session_id}")).json()
        return True if body["status"] == "idle" and not body["owedInputs"] else None

    try:
        await eventually(idle, f"{session_id} to settle")
    except AssertionError:
        for fact in await stack.facts(session_id):
            print(fact.seq, fact.kind, json.dumps(fact.data)[:300])
        print((await stack.http.get(f"/v1/sessions/{session_id}")).json())
        raise


async def play(stack: Stack, session_id: str, rng: random.Random, steps: int) -> None:
    for step in range(steps):
        op = rng.choice(OPS)
        tag = f"{session_id}-{step}"
        if op == "cancel":
            response = await stack.http.post(f"/v1/sessions/{session_id}/cancel")
            assert response.status_code in (200, 202), response.text
            continue
        if op == "settle":
            await settled(stack, session_id)
            continue
        text = {
            "text": f"{tag} hello",
            "slow": f"/slow 0.3 {tag} slowly",
            "tool": "/tool counter " + json.dumps({"key": tag}),
            "long": "/long 500",
        }[op]
        response = await stack.post_input(session_id, text, tag)
        assert response.status_code == 202, response.text
    await settled(stack, session_id)


async def grow_until_compacted(stack: Stack, session_id: str) -> None:
    """Long answers, one at a time, until the session has compacted: how
    much a random schedule batches decides whether it compacted by itself."""
    for turn in range(12):
        facts = await stack.facts(session_id)
        if any(f.kind == "compaction" for f in facts):
            return
        response = await stack.post_input(session_id, "/long 500", f"{session_id}-grow-{turn}")
        assert response.status_code == 202, response.text
        await settled(stack, session_id)
    raise AssertionError(f"{session_id} never compacted")


def recorded_turns(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["purpose"] == "turn"]


async def check_session(stack: Stack, session_id: str, record: Path) -> int:
    facts: list[CommittedFact] = await stack.facts(session_id)
    answers = {
        f.data["generationId"]: f
        for f in facts
        if f.kind == "assistant" and f.data.get("generationId", "").startswith("gen-")
    }
    text_of_input = {f.seq: f.data["text"] for f in facts if f.kind == "input"}
    checked = 0
    for request in recorded_turns(record):
        check_well_formed(request["messages"])
        answer = answers.get(request["generationId"])
        if answer is None:
            continue  # abandoned by a cancel: nothing was answered from it
        head = int(request["generationId"].removeprefix("gen-"))
        response = await stack.http.get(f"/v1/sessions/{session_id}/context", params={"at": head})
        assert response.status_code == 200, response.text
        context = response.json()
        assert context["messages"] == request["messages"], f"context at {head}"
        assert context["systemPrompt"] == request["system"]
        if not answer.data.get("toolCalls"):
            consumed = [text_of_input[seq] for seq in answer.data.get("inputSeqs") or ()]
            trailing = trailing_inputs(request["messages"])
            if is_summary(request["messages"][0]):
                # A compaction that split a turn summarized the turn's start.
                assert trailing == consumed[len(consumed) - len(trailing) :]
            else:
                assert trailing == consumed
        checked += 1
    return checked


@pytest.mark.parametrize("seed", [7, 1913])
async def test_what_the_model_sees_over_random_interleavings(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    await stack.cluster.kernel.put_loadout(
        "default",
        {
            "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": 3000},
            "compaction": {"enabled": True, "keepRecentTokens": 600, "reserveTokens": 800},
        },
    )
    await start_compacting_runner(stack)
    rng = random.Random(seed)
    checked = 0
    for index in range(3):
        record = tmp_path / f"requests-{index}.jsonl"
        monkeypatch.setenv("KEEL_RECORD_REQUESTS", str(record))
        session_id = await stack.new_session(f"mix-{seed}-{index}")
        await play(stack, session_id, rng, steps=14)
        await grow_until_compacted(stack, session_id)
        checked += await check_session(stack, session_id, record)
    assert checked >= 6, "the schedules answered too little to check anything"
