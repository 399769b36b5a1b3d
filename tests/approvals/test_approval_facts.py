"""The ledger's rules for approvals, on a real ledger (both backends).

`approval_requested` is a runner's fact (fenced), once per call: a retried
attempt asking again is a duplicate with the first one's seq. `approval` is
a client's fact, exactly once per waiting call, decided on the session's
aggregate: two ledger processes racing decisions for one call on one
PostgreSQL land exactly one. A waiting call is not owed work, nor is an
input behind it, until the decision (or a cancel) comes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common.config import Settings
from services.ledger import FactToAppend, InvalidFact, InvalidId, LedgerClient
from services.ledger.errors import ApprovalDecided, ApprovalNotPending, UnknownToolCall
from tests.support.cluster import running_ledger

CALL = {"id": "call-1", "name": "counter", "arguments": {"key": "k"}}


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[LedgerClient]:
    async with (
        running_ledger(settings) as server,
        LedgerClient(server.target, settings) as ledger_client,
    ):
        yield ledger_client


async def a_call_is_made(
    client: LedgerClient, session_id: str, calls: list[dict[str, object]]
) -> None:
    """An input, an epoch and an answer making `calls`, as a runner writes them."""
    await client.create_session(session_id, "t")
    await client.append_one(session_id, "input", {"text": "go", "requestId": "r1"})
    await client.append_one(
        session_id,
        "epoch_started",
        {"epoch": 1, "runtimeId": "rt", "attemptId": "a1", "watermark": 2},
        epoch=1,
    )
    await client.append_one(
        session_id, "assistant", {"generationId": "gen-2", "toolCalls": calls}, epoch=1
    )


def asked(call_id: str = "call-1") -> dict[str, object]:
    return {"toolCallId": call_id, "name": "counter", "arguments": {"key": "k"}}


def decision(approve: bool, call_id: str = "call-1") -> dict[str, object]:
    return {"toolCallId": call_id, "approve": approve, "by": "key:abc", "note": "ok"}


async def test_a_request_is_once_per_call_and_only_for_an_open_call(client: LedgerClient) -> None:
    await a_call_is_made(client, "s", [CALL])
    first = await client.append_one("s", "approval_requested", asked(), epoch=1)
    again = await client.append_one("s", "approval_requested", asked(), epoch=1)
    assert (first.seq, first.duplicate) == (5, False)
    assert (again.seq, again.duplicate) == (5, True)
    with pytest.raises(UnknownToolCall):
        await client.append_one("s", "approval_requested", asked("nope"), epoch=1)
    # A runner's fact: a client (epoch 0) may not write it.
    with pytest.raises(InvalidFact):
        await client.append_one("s", "approval_requested", asked())
    # Shapes are checked before anything is decided.
    with pytest.raises(InvalidFact):
        await client.append_one(
            "s", "approval_requested", {"toolCallId": "call-1", "name": "counter"}, epoch=1
        )


async def test_a_call_with_a_result_cannot_be_asked_about(client: LedgerClient) -> None:
    await a_call_is_made(client, "s", [CALL])
    await client.append_one("s", "tool_result", {"toolCallId": "call-1", "content": "1"}, epoch=1)
    with pytest.raises(InvalidFact):
        await client.append_one("s", "approval_requested", asked(), epoch=1)


async def test_exactly_one_decision_per_waiting_call(client: LedgerClient) -> None:
    await a_call_is_made(client, "s", [CALL])
    # Nothing asked yet: no decision can land.
    with pytest.raises(ApprovalNotPending):
        await client.append_one("s", "approval", decision(True))
    await client.append_one("s", "approval_requested", asked(), epoch=1)
    with pytest.raises(ApprovalNotPending):
        await client.append_one("s", "approval", decision(True, "no-such-call"))
    landed = await client.append_one("s", "approval", decision(False))
    assert not landed.duplicate
    for approve in (True, False):
        with pytest.raises(ApprovalDecided) as caught:
            await client.append_one("s", "approval", decision(approve))
        assert caught.value.metadata == {"seq": str(landed.seq), "approve": "false"}
    kinds = [f.kind for f in await client.read_all("s")]
    assert kinds.count("approval") == 1


async def test_decisions_are_checked_for_shape(client: LedgerClient) -> None:
    await a_call_is_made(client, "s", [CALL])
    await client.append_one("s", "approval_requested", asked(), epoch=1)
    for wrong in (
        {"toolCallId": "call-1", "approve": "yes", "by": "k"},
        {"toolCallId": "call-1", "approve": True},
        {"toolCallId": "call-1", "approve": True, "by": ""},
        {"toolCallId": "call-1", "approve": True, "by": "k", "note": "x" * 5000},
        {"toolCallId": "bad id", "approve": True, "by": "k"},
    ):
        with pytest.raises((InvalidFact, InvalidId)):
            await client.append_one("s", "approval", wrong)


async def test_a_cancelled_waiting_call_takes_no_decision(client: LedgerClient) -> None:
    await a_call_is_made(client, "s", [CALL])
    await client.append_one("s", "approval_requested", asked(), epoch=1)
    await client.append_one("s", "cancelled", {"reason": "client"})
    await client.append_one(
        "s", "tool_result", {"toolCallId": "call-1", "content": "cancelled", "isError": True}, 1
    )
    with pytest.raises(ApprovalNotPending):
        await client.append_one("s", "approval", decision(True))


async def test_a_waiting_call_is_not_owed_work(client: LedgerClient) -> None:
    """What the kernel's reconciliation reads: owes_work of each session."""
    await a_call_is_made(client, "s", [CALL, {"id": "call-2", "name": "clock", "arguments": {}}])
    await client.append_one("s", "approval_requested", asked(), epoch=1)

    async def owes() -> bool:
        page = await client.list_sessions(owing_only=False)
        return next(s.owes_work for s in page.sessions if s.session_id == "s")

    # call-2 needs no approval and has no result yet: that is work.
    assert await owes()
    await client.append_one("s", "tool_result", {"toolCallId": "call-2", "content": "t"}, 1)
    # Only the waiting call is left, with the input behind it: no work.
    assert not await owes()
    await client.append_one("s", "input", {"text": "meanwhile", "requestId": "r2"})
    assert not await owes(), "an input behind a waiting call waits with it"
    view = await client.get_session("s")
    assert [c.tool_call_id for c in view.open_tool_calls] == ["call-1"]
    assert view.owed_input_seqs == (2, 7)
    await client.append_one("s", "approval", decision(True))
    assert await owes(), "a decision makes the call owed again"


async def test_a_cancel_behind_a_waiting_call_is_work(client: LedgerClient) -> None:
    await a_call_is_made(client, "s", [CALL])
    await client.append_one("s", "approval_requested", asked(), epoch=1)
    await client.append_one("s", "cancelled", {"reason": "client"})
    page = await client.list_sessions(owing_only=True)
    assert [s.session_id for s in page.sessions] == ["s"]


async def test_racing_decisions_through_two_ledger_processes_land_once(
    two_ledgers: tuple[str, str], pg_settings: Settings
) -> None:
    first, second = two_ledgers
    calls = [{"id": f"call-{i}", "name": "counter", "arguments": {}} for i in range(8)]
    async with (
        LedgerClient(first, pg_settings) as one,
        LedgerClient(second, pg_settings) as two,
    ):
        await a_call_is_made(one, "race", calls)
        await one.append(
            "race", [FactToAppend("approval_requested", asked(str(c["id"]))) for c in calls], 1
        )

        async def decide(client: LedgerClient, call_id: str, approve: bool) -> bool:
            try:
                await client.append_one("race", "approval", decision(approve, call_id))
            except ApprovalDecided:
                return False
            return True

        outcomes = await asyncio.gather(
            *(
                decide(client, str(call["id"]), approve)
                for call in calls
                for client, approve in ((one, True), (two, False), (one, False), (two, True))
            )
        )
        for index in range(len(calls)):
            assert sum(outcomes[index * 4 : index * 4 + 4]) == 1, f"call-{index}"
        facts = await one.read_all("race")
        decided = [f.data["toolCallId"] for f in facts if f.kind == "approval"]
        assert sorted(decided) == sorted(str(c["id"]) for c in calls)
