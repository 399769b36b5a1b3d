"""Never run a call the model did not make (issue item 9, the attempt's side).

A call whose arguments were not a JSON object (the assistant fact keeps the
model's text as `argumentsText`) and the calls of a response cut at the
output limit (`stopReason: length`) are not run, and not put to a person
either: each gets an error result naming the problem, and the session goes
on to an answer. `counter` needs approval in these tests, so a call that
slipped through would show as an `approval_requested`.
"""

from __future__ import annotations

import pytest

from tests.support.approvals import (
    claim_as_writer,
    counter_store,
    kinds,
    require_approval,
    until_answered,
)
from tests.support.edge_stack import Stack

pytestmark = pytest.mark.slow


async def test_arguments_that_are_not_an_object_are_not_run(stack: Stack) -> None:
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    await cluster.runner_ready(cluster.start_runner())
    session_id = await stack.new_session()
    raw = '{"key": "malformed", "by'
    posted = await stack.post_input(session_id, f"/tool counter {raw}", "in-1")
    seq = int(posted.json()["seq"])

    facts = await until_answered(cluster.ledger, stack.ledger_id(session_id), seq)
    [call] = [c for f in kinds(facts, "assistant") for c in f.data.get("toolCalls") or ()]
    assert call["argumentsText"] == raw, "the model's own arguments are kept as sent"
    assert kinds(facts, "approval_requested") == []
    [result] = kinds(facts, "tool_result")
    assert result.data["isError"]
    assert result.data["content"] == (
        f"not run: the arguments of counter are not a JSON object: {raw!r}"
    )
    assert counter_store(cluster.settings).executions("malformed") == 0


async def test_the_calls_of_a_response_cut_at_the_output_limit_are_not_run(
    stack: Stack,
) -> None:
    """The answer is committed here as a runner would (the offline model
    never cuts a tool call): a claim, its epoch, the cut answer, a release;
    then a real runner takes the session over and settles the call."""
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    session_id = await stack.new_session()
    ledger_id = stack.ledger_id(session_id)
    appended = await cluster.ledger.append_one(
        ledger_id, "input", {"text": "count, please", "requestId": "in-1"}
    )
    seq = appended.seq
    await cluster.kernel.enqueue(ledger_id, "default", seq)
    lease = await claim_as_writer(cluster.kernel, "cut-writer")
    assert lease.session_id == ledger_id
    await cluster.ledger.append_one(
        ledger_id,
        "epoch_started",
        {"epoch": lease.epoch, "runtimeId": "cut-writer", "attemptId": "a1", "watermark": seq},
        epoch=lease.epoch,
    )
    await cluster.ledger.append_one(
        ledger_id,
        "assistant",
        {
            "generationId": f"gen-{seq}",
            "content": [{"type": "text", "text": "Counting"}],
            "toolCalls": [{"id": "call-cut", "name": "counter", "arguments": {"key": "cut"}}],
            "stopReason": "length",
        },
        epoch=lease.epoch,
    )
    await cluster.kernel.release(ledger_id, lease.epoch, "cut-writer")

    await cluster.runner_ready(cluster.start_runner())
    facts = await until_answered(cluster.ledger, ledger_id, seq)
    assert kinds(facts, "approval_requested") == []
    [result] = kinds(facts, "tool_result")
    assert result.data["toolCallId"] == "call-cut" and result.data["isError"]
    assert "cut off at the output limit" in result.data["content"]
    assert counter_store(cluster.settings).executions("cut") == 0
    epochs = [f.data["epoch"] for f in kinds(facts, "epoch_started")]
    assert epochs == [lease.epoch, lease.epoch + 1], "a real runner took over"
