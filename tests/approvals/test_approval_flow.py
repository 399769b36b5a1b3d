"""Approvals end to end, through both front doors (SPEC §12).

A real runner process with a loadout whose `counter` needs approval: the
offline model calls `counter`, the runner commits `approval_requested` and
the attempt ends — the kernel holds no lease and no admission slot for the
session, the runner runs nothing. A decision through HTTP or the gRPC API
commits `approval` and wakes the session: approved, the counter runs once;
denied, the model gets an error result naming who denied it and why. A
second decision, or one for a call that does not wait, is refused (409 /
ALREADY_EXISTS or FAILED_PRECONDITION); bad shapes are 400 /
INVALID_ARGUMENT; another tenant's session is a 404.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import grpc
import pytest

from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from keel_client import (
    ApprovalAlreadyDecided,
    ApprovalNotPending,
    AsyncKeelClient,
    Decision,
    InvalidArgument,
    KeelClient,
    SessionNotFound,
)
from tests.support.approvals import (
    DEADLINE_S,
    counter_store,
    holds_nothing,
    kinds,
    require_approval,
    until_answered,
    until_waiting,
)
from tests.support.edge_stack import ADMIN_KEY, Stack
from tests.support.polling import eventually
from tests.support.processes import ChildProcess

pytestmark = pytest.mark.slow

OTHER_KEY = "approvals-other-tenant-key-0123"


async def a_waiting_call(stack: Stack, key: str) -> tuple[str, int, dict[str, Any]]:
    """A session whose `counter {key}` call waits: (session id, input seq, pending)."""
    session_id = await stack.new_session()
    posted = await stack.post_input(session_id, f'/tool counter {{"key": "{key}"}}', f"in-{key}")
    assert posted.status_code == 202, posted.text
    session = await until_waiting(stack.http, session_id)
    [pending] = session["pendingApprovals"]
    assert pending["name"] == "counter"
    assert pending["arguments"] == {"key": key}
    assert session["owedInputs"] == [posted.json()["seq"]]
    return session_id, posted.json()["seq"], pending


async def runner_holds_nothing(stack: Stack) -> None:
    """Every runner the edge sees is live and runs nothing, for nobody."""
    status = (await stack.http.get("/v1/runtime/status")).json()
    runners = [r for r in status["runtimes"] if r["role"] == "runner" and r["liveness"] == "live"]
    assert runners, status
    for runner in runners:
        assert runner["inFlightRuns"] == 0, runner
        assert runner["sessions"] == [], runner


async def decide_http(
    stack: Stack, session_id: str, call_id: str, approve: bool, note: str
) -> tuple[int, str]:
    response = await stack.http.post(
        f"/v1/sessions/{session_id}/approvals",
        json={"toolCallId": call_id, "approve": approve, "note": note},
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["toolCallId"] == call_id and body["approve"] is approve
    return int(body["seq"]), str(body["by"])


async def decide_grpc(
    stack: Stack, session_id: str, call_id: str, approve: bool, note: str
) -> tuple[int, str]:
    """Through the Python client: the async one approves, the blocking one
    (in a thread) denies."""
    async with AsyncKeelClient(stack.grpc_address, ADMIN_KEY) as keel:
        session = await keel.get_session(session_id)
        assert session.status == "awaiting_approval"
        assert [p.tool_call_id for p in session.pending_approvals] == [call_id]
        assert session.pending_approvals[0].arguments == {"key": f"{session_id}-k"}
        if approve:
            decided = await keel.decide_approval(session_id, call_id, approve, note)
            return decided.seq, decided.by

    def deny() -> Decision:
        with KeelClient(stack.grpc_address, ADMIN_KEY) as blocking:
            return blocking.decide_approval(session_id, call_id, approve, note)

    decided = await asyncio.to_thread(deny)
    return decided.seq, decided.by


@pytest.mark.parametrize("door", ["http", "grpc"])
@pytest.mark.parametrize("approve", [True, False], ids=["approve", "deny"])
async def test_a_decision_runs_or_refuses_the_waiting_call(
    stack: Stack, door: str, approve: bool
) -> None:
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    runner = cluster.start_runner()
    await cluster.runner_ready(runner)
    counter = counter_store(cluster.settings)

    session_id = await stack.new_session()
    key = f"{session_id}-k"
    posted = await stack.post_input(session_id, f'/tool counter {{"key": "{key}"}}', "in-1")
    seq = posted.json()["seq"]
    [pending] = (await until_waiting(stack.http, session_id))["pendingApprovals"]
    ledger_id = stack.ledger_id(session_id)

    # Waiting holds nothing: no lease, nothing queued, no slot, no run.
    await holds_nothing(cluster.kernel, ledger_id)
    assert cluster.kernel_server.leases is not None
    assert cluster.kernel_server.leases.slots("default")[0] == 0
    await runner_holds_nothing(stack)
    assert counter.executions(key) == 0

    decide = decide_http if door == "http" else decide_grpc
    note = "go ahead" if approve else "not on a Friday"
    decision_seq, by = await decide(stack, session_id, pending["toolCallId"], approve, note)
    # Who decided: the id of the key the decision was made with.
    key_ids = {info.key_id for info in await cluster.kernel.list_api_keys("default")}
    assert by in key_ids, (by, key_ids)

    facts = await until_answered(cluster.ledger, ledger_id, seq)
    [decision] = kinds(facts, "approval")
    assert decision.seq == decision_seq and decision.epoch == 0
    assert decision.data == {
        "toolCallId": pending["toolCallId"],
        "approve": approve,
        "by": by,
        "note": note,
    }
    [result] = kinds(facts, "tool_result")
    assert result.data["toolCallId"] == pending["toolCallId"]
    assert len(kinds(facts, "approval_requested")) == 1
    if approve:
        assert not result.data["isError"]
        assert counter.value(key) == 1 and counter.executions(key) == 1
    else:
        assert result.data["isError"]
        assert result.data["content"] == f"denied by {by}: {note}"
        assert counter.executions(key) == 0
    # The note is the person's, never part of the call.
    [answer] = [f for f in kinds(facts, "assistant") if f.data.get("toolCalls")]
    assert answer.data["toolCalls"][0]["arguments"] == {"key": key}
    session = (await stack.http.get(f"/v1/sessions/{session_id}")).json()
    assert session["pendingApprovals"] == [] and session["owedInputs"] == []


async def test_refusals_through_both_doors(stack: Stack) -> None:
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    await cluster.runner_ready(cluster.start_runner())
    session_id, _, pending = await a_waiting_call(stack, "refusals")
    call_id = pending["toolCallId"]
    url = f"/v1/sessions/{session_id}/approvals"

    # Bad shapes: nothing is committed.
    for body in (
        {"toolCallId": call_id},
        {"toolCallId": call_id, "approve": "yes"},
        {"approve": True},
        {"toolCallId": "a b", "approve": True},
        {"toolCallId": call_id, "approve": True, "note": 5},
        {"toolCallId": call_id, "approve": True, "by": "me"},
    ):
        refused = await stack.http.post(url, json=body)
        assert refused.status_code == 400, (body, refused.text)
    unknown = await stack.http.post(url, json={"toolCallId": "call-nope", "approve": True})
    assert unknown.status_code == 409
    assert unknown.json()["error"]["code"] == "approval_not_pending"

    async with AsyncKeelClient(stack.grpc_address, ADMIN_KEY) as keel:
        with pytest.raises(ApprovalNotPending) as not_pending:
            await keel.decide_approval(session_id, "call-nope", True)
        assert not_pending.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(SessionNotFound):
            await keel.decide_approval("no-such-session", call_id, True)
        # proto3 `optional`: a request without a decision is refused, not a denial.
        channel = grpc.aio.insecure_channel(stack.grpc_address)
        try:
            stub = pb_grpc.SessionServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as absent:
                await stub.DecideApproval(
                    pb.DecideApprovalRequest(session_id=session_id, tool_call_id=call_id),
                    metadata=(("authorization", f"Bearer {ADMIN_KEY}"),),
                )
            assert absent.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await channel.close(None)

        first = await keel.decide_approval(session_id, call_id, True, "once")
        with pytest.raises(ApprovalAlreadyDecided) as decided:
            await keel.decide_approval(session_id, call_id, False)
        assert decided.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert decided.value.metadata["seq"] == str(first.seq)
        assert decided.value.metadata["approve"] == "true"
        with pytest.raises(InvalidArgument):
            await keel.decide_approval(session_id, "a b", True)

    again = await stack.http.post(url, json={"toolCallId": call_id, "approve": False})
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "approval_already_decided"
    assert f"seq {first.seq}" in again.json()["error"]["message"]

    # Another tenant's session is a 404, through either door.
    await cluster.kernel.create_tenant("other", "Other")
    await cluster.kernel.create_api_key("other", OTHER_KEY)
    async with stack.client(OTHER_KEY) as other:
        foreign = await other.post(url, json={"toolCallId": call_id, "approve": True})
        assert foreign.status_code == 404
        assert (await other.get(f"/v1/sessions/{session_id}")).status_code == 404
    async with AsyncKeelClient(stack.grpc_address, OTHER_KEY) as keel:
        with pytest.raises(SessionNotFound):
            await keel.decide_approval(session_id, call_id, True)

    facts = await stack.facts(session_id)
    assert len(kinds(facts, "approval")) == 1


async def test_an_input_while_a_call_waits_stays_owed_until_the_decision(stack: Stack) -> None:
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    await cluster.runner_ready(cluster.start_runner())
    session_id, first_seq, pending = await a_waiting_call(stack, "meanwhile")
    ledger_id = stack.ledger_id(session_id)
    await holds_nothing(cluster.kernel, ledger_id)
    before = await stack.facts(session_id)

    posted = await stack.post_input(session_id, "and also this", "in-later")
    later_seq = posted.json()["seq"]
    # The input wakes the session; the attempt finds the model cannot be
    # asked while the call waits, writes nothing, and ends.
    await holds_nothing(cluster.kernel, ledger_id)
    session = await until_waiting(stack.http, session_id)
    assert session["owedInputs"] == [first_seq, later_seq]
    assert [f.seq for f in await stack.facts(session_id)] == [*[f.seq for f in before], later_seq]

    await decide_http(stack, session_id, pending["toolCallId"], True, "")
    facts = await until_answered(cluster.ledger, ledger_id, later_seq)
    [final] = [f for f in kinds(facts, "assistant") if f.data.get("inputSeqs")]
    assert final.data["inputSeqs"] == [first_seq, later_seq]
    [decision] = kinds(facts, "approval")
    assert "note" not in decision.data


async def test_a_cancel_closes_a_waiting_call(stack: Stack) -> None:
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    await cluster.runner_ready(cluster.start_runner())
    session_id, seq, pending = await a_waiting_call(stack, "cancelled")
    cancelled = await stack.http.post(f"/v1/sessions/{session_id}/cancel")
    assert cancelled.status_code == 202, cancelled.text

    facts = await until_answered(cluster.ledger, stack.ledger_id(session_id), seq)
    [result] = kinds(facts, "tool_result")
    assert result.data == {
        "toolCallId": pending["toolCallId"],
        "content": "cancelled",
        "isError": True,
    }
    late = await stack.http.post(
        f"/v1/sessions/{session_id}/approvals",
        json={"toolCallId": pending["toolCallId"], "approve": True},
    )
    assert late.status_code == 409
    assert late.json()["error"]["code"] == "approval_not_pending"
    await holds_nothing(cluster.kernel, stack.ledger_id(session_id))
    session = (await stack.http.get(f"/v1/sessions/{session_id}")).json()
    assert session["status"] == "idle" and session["pendingApprovals"] == []
    assert counter_store(cluster.settings).executions("cancelled") == 0


async def test_keel_chat_asks_and_decides(stack: Stack) -> None:
    """`keel chat` opened on a session whose call waits asks about it once
    (the history is replayed, then the question), takes `n` and a note;
    then a call made from the chat is asked about and approved."""
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    await cluster.runner_ready(cluster.start_runner())
    session_id, _, _ = await a_waiting_call(stack, "chat-a")
    script = (
        "import asyncio, sys\n"
        "from services.cli.chat import run_chat\n"
        "asyncio.run(run_chat(sys.argv[1], sys.argv[2], sys.argv[3]))\n"
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="300")
    child = ChildProcess([sys.executable, "-c", script, stack.url, ADMIN_KEY, session_id], env=env)
    first = 'approve counter({"key": "chat-a"})? [y/n]'
    second = 'approve counter({"key": "chat-b"})? [y/n]'
    try:
        await child.line(lambda line: first in line, DEADLINE_S)
        child.send_line("n")
        await child.line(lambda line: "note (Enter for none):" in line, DEADLINE_S)
        child.send_line("not this one")
        await child.line(lambda line: "✗ denied counter" in line, DEADLINE_S)

        child.send_line('/tool counter {"key": "chat-b"}')
        await child.line(lambda line: second in line, DEADLINE_S)
        child.send_line("y")
        await eventually(
            lambda: _seen(child, "note (Enter for none):", 2), "the second note prompt"
        )
        child.send_line("")
        await child.line(lambda line: "✓ approved counter" in line, DEADLINE_S)
        await child.line(lambda line: "counter returned" in line, DEADLINE_S)
        assert child.proc.stdin is not None
        child.proc.stdin.close()
        code = await asyncio.to_thread(child.proc.wait, DEADLINE_S)
    finally:
        child.kill()
    output = child.output()
    assert code == 0, output
    assert output.count(first) == 1 and output.count(second) == 1, output
    counter = counter_store(cluster.settings)
    assert counter.executions("chat-a") == 0 and counter.value("chat-b") == 1
    decisions = kinds(await stack.facts(session_id), "approval")
    assert [(d.data["approve"], d.data.get("note")) for d in decisions] == [
        (False, "not this one"),
        (True, None),
    ]


async def _seen(child: ChildProcess, text: str, times: int) -> bool | None:
    """True once `text` is in `times` lines of the child's output."""
    return True if sum(text in line for line in list(child.lines)) >= times else None
