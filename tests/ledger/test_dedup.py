"""Retries are safe: request, generation and tool-call ids deduplicate."""

from __future__ import annotations

import asyncio

import pytest

from services.ledger import (
    FactToAppend,
    IdempotencyConflict,
    LedgerClient,
    LedgerServer,
    UnknownToolCall,
)


async def start_epoch(client: LedgerClient, session_id: str, epoch: int) -> None:
    await client.append_one(
        session_id,
        "epoch_started",
        {"epoch": epoch, "runtimeId": "rt", "attemptId": f"a{epoch}", "watermark": 0},
        epoch=epoch,
    )


async def test_request_id_dedup(client: LedgerClient) -> None:
    await client.create_session("s", "t")
    first = await client.append_one("s", "input", {"text": "hello", "requestId": "r-1"})
    again = await client.append_one("s", "input", {"text": "hello", "requestId": "r-1"})
    assert (first.seq, first.duplicate) == (2, False)
    assert (again.seq, again.duplicate) == (2, True)
    with pytest.raises(IdempotencyConflict) as caught:
        await client.append_one("s", "input", {"text": "other", "requestId": "r-1"})
    assert caught.value.metadata["seq"] == "2"
    facts = await client.read_all("s")
    assert [f.kind for f in facts] == ["session_created", "input"]


async def test_generation_and_tool_call_dedup(client: LedgerClient) -> None:
    await client.create_session("s", "t")
    await client.append_one("s", "input", {"text": "hi", "requestId": "r"})
    await start_epoch(client, "s", 1)
    answer = {
        "generationId": "gen-1",
        "content": [{"type": "text", "text": "calling"}],
        "toolCalls": [{"id": "call-1", "name": "clock", "arguments": {}}],
    }
    a1 = await client.append_one("s", "assistant", answer, epoch=1)
    # A successor re-answering the same context computes the same id.
    await start_epoch(client, "s", 2)
    a2 = await client.append_one("s", "assistant", answer | {"content": []}, epoch=2)
    assert a2.seq == a1.seq and a2.duplicate

    view = await client.get_session("s")
    assert [c.tool_call_id for c in view.open_tool_calls] == ["call-1"]
    r1 = await client.append_one("s", "tool_result", {"toolCallId": "call-1", "content": "1"}, 2)
    r2 = await client.append_one("s", "tool_result", {"toolCallId": "call-1", "content": "2"}, 2)
    assert r2.seq == r1.seq and r2.duplicate and not r1.duplicate
    with pytest.raises(UnknownToolCall):
        await client.append_one("s", "tool_result", {"toolCallId": "nope", "content": ""}, 2)

    results = [f for f in await client.read_all("s") if f.kind == "tool_result"]
    assert len(results) == 1 and results[0].data["content"] == "1"
    assert (await client.get_session("s")).open_tool_calls == ()


async def test_concurrent_duplicates_from_two_clients(ledger: LedgerServer) -> None:
    async with (
        LedgerClient(ledger.target, ledger.settings) as one,
        LedgerClient(ledger.target, ledger.settings) as two,
    ):
        await one.create_session("dup", "t")
        await one.append_one("dup", "input", {"text": "q", "requestId": "r0"})
        await start_epoch(one, "dup", 1)
        await one.append_one(
            "dup",
            "assistant",
            {"generationId": "g0", "toolCalls": [{"id": "c1", "name": "counter"}]},
            epoch=1,
        )

        async def both(kind: str, data: dict[str, object], epoch: int) -> set[int]:
            fact = [FactToAppend(kind, data)]
            outcomes = await asyncio.gather(
                *(c.append("dup", fact, epoch) for c in (one, two) for _ in range(5))
            )
            assert sum(not o[0].duplicate for o in outcomes) == 1
            return {o[0].seq for o in outcomes}

        assert len(await both("input", {"text": "same", "requestId": "r1"}, 0)) == 1
        assert len(await both("assistant", {"generationId": "g1"}, 1)) == 1
        assert len(await both("tool_result", {"toolCallId": "c1", "content": "ok"}, 1)) == 1

        kinds = [f.kind for f in await one.read_all("dup")]
        assert kinds.count("input") == 2
        assert kinds.count("assistant") == 2
        assert kinds.count("tool_result") == 1


async def test_consumption_fact_settles_owed_inputs(client: LedgerClient) -> None:
    await client.create_session("s", "t")
    await client.append_one("s", "input", {"text": "a", "requestId": "r1"})
    await client.append_one("s", "input", {"text": "b", "requestId": "r2"})
    await start_epoch(client, "s", 1)
    assert (await client.get_session("s")).owed_input_seqs == (2, 3)
    await client.append_one("s", "assistant", {"generationId": "g", "inputSeqs": [2]}, epoch=1)
    view = await client.get_session("s")
    assert view.owed_input_seqs == (3,)
    assert view.fence_epoch == 1
