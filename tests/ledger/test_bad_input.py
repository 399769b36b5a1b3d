"""Bad input gets a clear status with a reason; the service keeps serving."""

from __future__ import annotations

import json

import grpc
import pytest

from keel.ledger.v1 import ledger_pb2 as pb
from keel.ledger.v1 import ledger_pb2_grpc as pb_grpc
from services.common.errors import error_info
from services.ledger import LedgerClient, LedgerServer
from tests.support.internal_auth import token_metadata


async def call_fails(
    ledger: LedgerServer, method: str, request: object, code: grpc.StatusCode, reason: str
) -> None:
    async with grpc.aio.insecure_channel(ledger.target) as channel:
        stub = pb_grpc.LedgerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            response = getattr(stub, method)(request, metadata=token_metadata())
            if method == "Subscribe":
                async for _ in response:
                    pass
            else:
                await response
        assert caught.value.code() == code, caught.value.details()
        info = error_info(caught.value)
        assert info is not None and info.reason == reason
        assert caught.value.details()


def append(session_id: str, kind: str, data: object, epoch: int = 0) -> pb.AppendRequest:
    text = data if isinstance(data, str) else json.dumps(data)
    return pb.AppendRequest(
        session_id=session_id, epoch=epoch, facts=[pb.NewFact(kind=kind, data_json=text)]
    )


@pytest.mark.parametrize("settings", ["sqlite"], indirect=True)
async def test_bad_input_is_refused_clearly(ledger: LedgerServer, client: LedgerClient) -> None:
    await client.create_session("s", "t")
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    not_found = grpc.StatusCode.NOT_FOUND
    good_input = {"text": "hi", "requestId": "r1"}
    cases: list[tuple[str, object, grpc.StatusCode, str]] = [
        ("Read", pb.ReadRequest(session_id="nope"), not_found, "SESSION_NOT_FOUND"),
        ("GetSession", pb.GetSessionRequest(session_id="nope"), not_found, "SESSION_NOT_FOUND"),
        ("Subscribe", pb.SubscribeRequest(session_id="nope"), not_found, "SESSION_NOT_FOUND"),
        ("Append", append("nope", "input", good_input), not_found, "SESSION_NOT_FOUND"),
        ("Read", pb.ReadRequest(session_id="s", after_seq=-1), invalid, "INVALID_CURSOR"),
        ("Subscribe", pb.SubscribeRequest(session_id="s", after_seq=-5), invalid, "INVALID_CURSOR"),
        ("Read", pb.ReadRequest(session_id="s", limit=-1), invalid, "INVALID_CURSOR"),
        ("Read", pb.ReadRequest(session_id="bad id!"), invalid, "INVALID_ID"),
        ("Read", pb.ReadRequest(session_id=""), invalid, "INVALID_ID"),
        (
            "CreateSession",
            pb.CreateSessionRequest(session_id="x" * 200, tenant_id="t"),
            invalid,
            "INVALID_ID",
        ),
        ("Append", append("s", "input", {"text": "hi", "requestId": "r/1"}), invalid, "INVALID_ID"),
        (
            "Append",
            append("s", "input", {"text": "x" * (2 << 20), "requestId": "big"}),
            invalid,
            "FACT_TOO_LARGE",
        ),
        ("Append", append("s", "mystery", {}), invalid, "INVALID_FACT"),
        ("Append", append("s", "input", "{not json"), invalid, "INVALID_FACT"),
        ("Append", append("s", "input", "[1, 2]"), invalid, "INVALID_FACT"),
        ("Append", append("s", "input", {"requestId": "r2"}), invalid, "INVALID_FACT"),
        ("Append", append("s", "input", {"text": 5, "requestId": "r2"}), invalid, "INVALID_FACT"),
        ("Append", append("s", "input", good_input | {"retryOf": 99}), invalid, "INVALID_FACT"),
        ("Append", append("s", "session_created", {}), invalid, "INVALID_FACT"),
        ("Append", append("s", "assistant", {"generationId": "g"}), invalid, "INVALID_FACT"),
        ("Append", append("s", "input", good_input, epoch=-1), invalid, "INVALID_FACT"),
        ("Append", pb.AppendRequest(session_id="s"), invalid, "INVALID_FACT"),
        ("Append", append("s", "epoch_started", {"epoch": 1}, epoch=1), invalid, "INVALID_FACT"),
        (
            "Append",
            append("s", "tool_result", {"toolCallId": "c"}, epoch=0),
            invalid,
            "INVALID_FACT",
        ),
        (
            "CreateSession",
            pb.CreateSessionRequest(session_id="s", tenant_id="other"),
            grpc.StatusCode.ALREADY_EXISTS,
            "SESSION_EXISTS",
        ),
    ]
    for method, request, code, reason in cases:
        await call_fails(ledger, method, request, code, reason)

    # Nothing of the refused requests was committed, and the service still works.
    assert [f.kind for f in await client.read_all("s")] == ["session_created"]
    appended = await client.append_one("s", "input", good_input)
    assert appended.seq == 2


@pytest.mark.parametrize("settings", ["sqlite"], indirect=True)
async def test_a_compaction_must_keep_from_a_committed_fact(
    ledger: LedgerServer, client: LedgerClient
) -> None:
    await client.create_session("c", "t")
    await client.append_one("c", "input", {"text": "hi", "requestId": "r1"})
    started = {"epoch": 1, "runtimeId": "rt", "attemptId": "a", "watermark": 2}
    await client.append_one("c", "epoch_started", started, epoch=1)
    beyond = append("c", "compaction", {"summary": "so far", "firstKept": 50}, epoch=1)
    await call_fails(ledger, "Append", beyond, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FACT")
    kept = await client.append_one("c", "compaction", {"summary": "so far", "firstKept": 2}, 1)
    assert kept.seq == 4
