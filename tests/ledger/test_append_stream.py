"""Appends over the pipelined AppendStream decide exactly as the unary Append.

`LedgerClient.append` rides one long-lived stream per client; `append_unary`
is the unary call. The fence, dedup and every refusal raise the same classes
on both; one session's appends keep their send order; a caller that gives up
does not break the stream; a stream that fails leaves every append it had not
answered retryable, and a ledger killed mid-stream loses and doubles nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

import grpc
import pytest

from keel.ledger.v1 import ledger_pb2 as pb
from keel.ledger.v1 import ledger_pb2_grpc as pb_grpc
from services.common import hops
from services.common.config import Settings
from services.common.errors import ServiceUnavailable
from services.ledger import (
    Appended,
    FactToAppend,
    IdempotencyConflict,
    InvalidFact,
    LedgerClient,
    LedgerError,
    LedgerServer,
    SessionNotFound,
    StaleEpoch,
)
from tests.support.databases import settings_env
from tests.support.internal_auth import token_metadata
from tests.support.processes import ChildProcess

AppendOne = Callable[[str, str, Mapping[str, object], int], Awaitable[Appended]]
STREAM = "keel.ledger.v1.LedgerService/AppendStream"
UNARY = "keel.ledger.v1.LedgerService/Append"
INPUT_R1 = '{"text": "x", "requestId": "r1"}'


def via(client: LedgerClient, path: str) -> AppendOne:
    """One fact appended over the stream (`append`) or the unary call."""
    send = client.append if path == "stream" else client.append_unary

    async def append_one(
        session_id: str, kind: str, data: Mapping[str, object], epoch: int = 0
    ) -> Appended:
        return (await send(session_id, [FactToAppend(kind, data)], epoch))[0]

    return append_one


def started(epoch: int) -> dict[str, object]:
    return {"epoch": epoch, "runtimeId": "rt", "attemptId": f"a{epoch}", "watermark": 0}


@pytest.mark.parametrize("path", ["stream", "unary"])
async def test_the_fence_refuses_the_same_way_on_both_paths(
    client: LedgerClient, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    append_one = via(client, path)
    await client.create_session("s", "t")
    await client.append_one("s", "epoch_started", started(1), epoch=1)
    await client.append_one("s", "epoch_started", started(2), epoch=2)
    head = (await client.get_session("s")).head_seq
    before = hops.snapshot()

    with (
        caplog.at_level(logging.INFO, logger="services.ledger.servicer"),
        pytest.raises(StaleEpoch) as caught,
    ):
        await append_one("s", "assistant", {"generationId": "g-old"}, 1)
    assert caught.value.metadata == {"epoch": "1", "fence": "2"}
    assert "stale append refused: session=s epoch=1 fence=2 kinds=assistant" in caplog.text
    with pytest.raises(InvalidFact):
        await append_one("s", "assistant", {"generationId": "g"}, 0)
    with pytest.raises(SessionNotFound):
        await append_one("nowhere", "input", {"text": "x", "requestId": "r"}, 0)
    assert (await client.get_session("s")).head_seq == head
    # The refusals were decided where the path says: a stream message or a call.
    counted = hops.snapshot().since(before).calls
    assert counted.get(STREAM if path == "stream" else UNARY, 0) >= 3
    assert counted.get(UNARY if path == "stream" else STREAM, 0) == 0


@pytest.mark.parametrize("path", ["stream", "unary"])
async def test_a_request_id_is_one_input_on_both_paths(client: LedgerClient, path: str) -> None:
    append_one = via(client, path)
    await client.create_session("s", "t")
    first = await append_one("s", "input", {"text": "hello", "requestId": "r-1"}, 0)
    again = await append_one("s", "input", {"text": "hello", "requestId": "r-1"}, 0)
    assert (first.seq, first.duplicate) == (2, False)
    assert (again.seq, again.duplicate) == (2, True)
    # Across the paths too: one store decides both.
    other = via(client, "unary" if path == "stream" else "stream")
    assert await other("s", "input", {"text": "hello", "requestId": "r-1"}, 0) == again
    with pytest.raises(IdempotencyConflict) as caught:
        await append_one("s", "input", {"text": "other", "requestId": "r-1"}, 0)
    assert caught.value.metadata["seq"] == "2"
    assert [f.kind for f in await client.read_all("s")] == ["session_created", "input"]


async def test_pipelined_appends_of_one_session_keep_their_send_order(
    client: LedgerClient,
) -> None:
    await client.create_session("s", "t")
    before = hops.snapshot()
    # Each task sends at its first step, and tasks start in creation order;
    # all of them are on the stream before the first answer is read.
    tasks = [
        asyncio.create_task(client.append_one("s", "input", {"text": "x", "requestId": f"r{i}"}))
        for i in range(200)
    ]
    results = await asyncio.gather(*tasks)
    assert [r.seq for r in results] == list(range(2, 202))
    assert not any(r.duplicate for r in results)
    facts = await client.read_all("s")
    assert [f.data.get("requestId") for f in facts[1:]] == [f"r{i}" for i in range(200)]
    counted = hops.snapshot().since(before).calls
    assert counted.get(STREAM, 0) >= 200 and counted.get(UNARY, 0) == 0


async def test_a_refusal_or_a_caller_that_gives_up_leaves_the_stream_to_the_others(
    client: LedgerClient,
) -> None:
    await client.create_session("s", "t")
    await client.append_one("s", "input", {"text": "x", "requestId": "r0"})
    refused = asyncio.create_task(client.append_one("s", "assistant", {"generationId": "g"}))
    abandoned = asyncio.create_task(
        client.append_one("s", "input", {"text": "x", "requestId": "gone"})
    )
    kept = asyncio.create_task(client.append_one("s", "input", {"text": "x", "requestId": "r1"}))
    # Awaiting lets every task send (they start in creation order) before
    # the first answer can be read.
    with pytest.raises(InvalidFact):
        await refused
    abandoned.cancel()  # whether or not its answer came already
    await asyncio.gather(abandoned, return_exceptions=True)
    kept_seq = (await kept).seq
    # The abandoned append was sent, so it was decided: once, before `kept`.
    again = await client.append_one("s", "input", {"text": "x", "requestId": "gone"})
    assert (again.seq, again.duplicate) == (kept_seq - 1, True)
    after = await client.append_one("s", "input", {"text": "x", "requestId": "r2"})
    assert (after.seq, after.duplicate) == (kept_seq + 1, False)


async def test_a_draining_ledger_answers_what_it_read_and_ends_the_stream_ok(
    ledger: LedgerServer, client: LedgerClient
) -> None:
    await client.create_session("s", "t")
    await client.append_one("s", "input", {"text": "x", "requestId": "r0"})  # opens its stream
    channel = grpc.aio.insecure_channel(ledger.target)
    try:
        stream = pb_grpc.LedgerServiceStub(channel).AppendStream(metadata=token_metadata())
        sent = pb.AppendStreamRequest(
            id=7,
            append=pb.AppendRequest(
                session_id="s", facts=[pb.NewFact(kind="input", data_json=INPUT_R1)]
            ),
        )
        await stream.write(sent)
        answer = await stream.read()
        assert answer.id == 7 and answer.appended.results[0].seq == 3
        drain = ledger.running.services[0].on_drain if ledger.running else None
        assert drain is not None
        await drain()
        # Ended by the server, cleanly, while the client still had it open.
        assert await asyncio.wait_for(stream.code(), 30) == grpc.StatusCode.OK
    finally:
        await channel.close(None)
    # The client's stream was ended too, and a draining ledger takes no new
    # one: the next append fails retryably (a replica would take it).
    with pytest.raises(ServiceUnavailable):
        await client.append_one("s", "input", {"text": "x", "requestId": "r2"})


async def test_a_stream_refused_whole_raises_what_the_unary_call_raises(
    ledger: LedgerServer,
) -> None:
    wrong = ledger.settings.with_overrides(internal_token="not-the-token")
    async with LedgerClient(ledger.target, wrong) as client:
        with pytest.raises(LedgerError) as on_unary:
            await client.append_unary("s", [FactToAppend("input", {"text": "x"})])
        with pytest.raises(LedgerError) as on_stream:
            await client.append("s", [FactToAppend("input", {"text": "x"})])
    assert type(on_stream.value) is type(on_unary.value)
    assert not isinstance(on_stream.value, ServiceUnavailable)


@pytest.mark.slow
async def test_a_ledger_killed_mid_stream_loses_and_doubles_no_append(
    pg_settings: Settings,
) -> None:
    env = settings_env(pg_settings)
    ledger = ChildProcess.python("-m", "services.ledger", "--address", "127.0.0.1:0", env=env)
    address = ledger.wait_listening()
    sessions = [f"s{i}" for i in range(4)]
    per_session = 150
    committed: dict[str, Appended] = {}
    retried: list[str] = []
    enough = asyncio.Event()

    async def write(client: LedgerClient, session_id: str) -> None:
        for i in range(per_session):
            request_id = f"{session_id}-r{i}"
            while True:
                try:
                    appended = await client.append_one(
                        session_id, "input", {"text": "x", "requestId": request_id}
                    )
                except ServiceUnavailable:
                    retried.append(request_id)
                    await asyncio.sleep(0.05)  # back off while the ledger is away
                    continue
                committed[request_id] = appended
                break
            if len(committed) >= len(sessions) * per_session // 4:
                enough.set()

    try:
        async with LedgerClient(address, pg_settings) as client:
            for session_id in sessions:
                await client.create_session(session_id, "t")
            writers = asyncio.gather(*(write(client, s) for s in sessions))
            await asyncio.wait_for(enough.wait(), 60)
            ledger.kill()  # SIGKILL while every writer has an append on the stream
            ledger = ChildProcess.python("-m", "services.ledger", "--address", address, env=env)
            await asyncio.to_thread(ledger.wait_listening)
            await asyncio.wait_for(writers, 120)

            assert retried, "the kill failed no append in flight"
            for session_id in sessions:
                facts = await client.read_all(session_id)
                ids = [f.data["requestId"] for f in facts if f.kind == "input"]
                assert ids == [f"{session_id}-r{i}" for i in range(per_session)]
                assert [f.seq for f in facts] == list(range(1, per_session + 2))
                # What each writer was told is what the ledger holds.
                for fact in facts[1:]:
                    assert committed[fact.data["requestId"]].seq == fact.seq
    finally:
        ledger.kill()
