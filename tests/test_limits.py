"""Size limits, on every way in: the ledger's fact limit (whoever appends),
the edge's request limit on both front doors (HTTP body, gRPC message), and
gRPC's transport limit on the internal servers. Each refusal names its
limit; none leaves a session unable to go on.

Small limits through the frozen settings, so no test moves megabytes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest

from edge.gateway import EdgeConfig
from edge.limits import ClientLimits
from edge.server import EdgeServer
from keel.ledger.v1 import ledger_pb2 as ledger_pb
from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from services.common.config import Settings
from services.common.serving import MESSAGE_OVERHEAD_BYTES, message_size_options
from services.ledger import FactTooLarge, LedgerClient, LedgerServer
from services.ledger.client import FactToAppend
from services.runner.config import RunnerConfig
from services.runner.fact_fit import fact_bytes, fit_fact
from services.runner.server import RunnerServer
from tests.support.cluster import Cluster, running_ledger, start_cluster, stop_cluster
from tests.support.grpc_fuzz import error_reason
from tests.support.internal_auth import token_metadata
from tests.support.polling import eventually

FACT_LIMIT = 4096
BODY_LIMIT = 4096
KEY = "limits-test-admin-key-0123456789"
AUTH = (("authorization", f"Bearer {KEY}"),)


# ------------------------------------------------------------------ ledger


@pytest.fixture
async def small_ledger(settings: Settings) -> AsyncIterator[LedgerClient]:
    limited = settings.with_overrides(max_fact_bytes=FACT_LIMIT)
    async with (
        running_ledger(limited, grace=0.2) as server,
        LedgerClient(server.target, limited) as client,
    ):
        yield client


async def test_a_fact_over_the_limit_is_refused_by_name(small_ledger: LedgerClient) -> None:
    await small_ledger.create_session("t:big", "t")
    text = "x" * FACT_LIMIT
    with pytest.raises(FactTooLarge) as refused:
        await small_ledger.append(
            "t:big", [FactToAppend("input", {"text": text, "requestId": "r1"})]
        )
    assert refused.value.reason == "FACT_TOO_LARGE"
    assert refused.value.metadata["limit"] == str(FACT_LIMIT)
    # Nothing was written, and the session takes the next fact as usual.
    ok = await small_ledger.append(
        "t:big", [FactToAppend("input", {"text": "ok", "requestId": "r2"})]
    )
    assert ok[0].seq == 2


async def test_the_fact_limit_counts_bytes_not_characters(small_ledger: LedgerClient) -> None:
    """Regression: the limit compared characters, so non-ASCII text up to
    four times the limit in bytes was stored."""
    await small_ledger.create_session("t:wide", "t")
    wide = "é" * (FACT_LIMIT // 2)  # under the limit in characters, over it in bytes
    assert len(json.dumps({"text": wide}, ensure_ascii=False)) < FACT_LIMIT
    with pytest.raises(FactTooLarge) as refused:
        await small_ledger.append(
            "t:wide", [FactToAppend("input", {"text": wide, "requestId": "r1"})]
        )
    assert int(refused.value.metadata["size"]) > FACT_LIMIT


# ------------------------------------------------------------------ gRPC transport


def test_a_transport_limit_below_the_fact_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="KEEL_GRPC_MAX_MESSAGE_BYTES"):
        message_size_options(Settings(max_fact_bytes=1 << 20, grpc_max_message_bytes=1 << 20))
    env = {"KEEL_GRPC_MAX_MESSAGE_BYTES": "123456", "KEEL_MAX_FACT_BYTES": "1000"}
    assert dict(message_size_options(Settings.from_env(env))) == {
        "grpc.max_send_message_length": 123456,
        "grpc.max_receive_message_length": 123456,
    }


async def test_an_internal_server_refuses_a_message_over_its_limit(
    pg_settings: Settings,
) -> None:
    limit = FACT_LIMIT + MESSAGE_OVERHEAD_BYTES
    limited = pg_settings.with_overrides(max_fact_bytes=FACT_LIMIT, grpc_max_message_bytes=limit)
    server = await LedgerServer(limited).start()
    # A channel that sends anything: the server's own limit must refuse it.
    channel = grpc.aio.insecure_channel(
        server.target, options=[("grpc.max_send_message_length", 4 * limit)]
    )
    try:
        append = channel.unary_unary(
            "/keel.ledger.v1.LedgerService/Append",
            request_serializer=ledger_pb.AppendRequest.SerializeToString,
            response_deserializer=ledger_pb.AppendResponse.FromString,
        )
        huge = ledger_pb.AppendRequest(
            session_id="t:s", facts=[ledger_pb.NewFact(kind="input", data_json="x" * 2 * limit)]
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await append(huge, metadata=token_metadata())
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(limit) in (refused.value.details() or "")
    finally:
        await channel.close(None)
        await server.stop(grace=0.2)


# ------------------------------------------------------------------ edge, both doors


@dataclass
class SmallEdge:
    cluster: Cluster
    edge: EdgeServer
    http: httpx.AsyncClient


@pytest.fixture
async def small_edge(pg_settings: Settings) -> AsyncIterator[SmallEdge]:
    settings = pg_settings.with_overrides(max_fact_bytes=FACT_LIMIT)
    cluster = await start_cluster(settings, backoff_base_ms=100, max_attempts=2)
    edge: EdgeServer | None = None
    try:
        await cluster.kernel.create_api_key("default", KEY, admin=True, operator=True)
        config = EdgeConfig(cluster.ledger_server.target, cluster.kernel_server.target, grpc_port=0)
        edge = await EdgeServer(
            settings, config, limits=ClientLimits(max_body_bytes=BODY_LIMIT)
        ).start()
        async with httpx.AsyncClient(
            base_url=edge.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ) as http:
            yield SmallEdge(cluster, edge, http)
    finally:
        if edge is not None:
            await edge.stop()
        await stop_cluster(cluster)


def test_the_request_limit_is_configurable() -> None:
    assert ClientLimits.from_env({"KEEL_EDGE_MAX_BODY_BYTES": "2048"}).max_body_bytes == 2048
    with pytest.raises(ValueError, match="KEEL_EDGE_MAX_BODY_BYTES"):
        ClientLimits(max_body_bytes=0)


async def test_an_http_body_over_the_limit_is_413_naming_it(small_edge: SmallEdge) -> None:
    http = small_edge.http
    created = await http.post("/v1/sessions", json={"id": "big"})
    assert created.status_code == 201, created.text
    body = {"text": "x" * BODY_LIMIT, "requestId": "r1"}
    for headers in ({}, {"Transfer-Encoding": "chunked"}):
        content = json.dumps(body).encode()

        async def chunks(data: bytes = content) -> AsyncIterator[bytes]:
            yield data

        # With a Content-Length, and without one (read until over the limit).
        sent = content if not headers else chunks()
        refused = await http.post("/v1/sessions/big/inputs", content=sent, headers=headers)
        assert refused.status_code == 413, refused.text
        error = refused.json()["error"]
        assert error["code"] == "payload_too_large"
        assert str(BODY_LIMIT) in error["message"]
    # The loadout, read by its own route, is held to the same limit.
    loadout = await http.put("/v1/loadout", content=b"{" + b" " * BODY_LIMIT + b"}")
    assert loadout.status_code == 413, loadout.text
    # Refused before anything was written; a small input still goes in.
    ok = await http.post("/v1/sessions/big/inputs", json={"text": "ok", "requestId": "r2"})
    assert ok.status_code == 202, ok.text
    assert ok.json()["seq"] == 2


async def test_a_grpc_request_over_the_limit_is_refused_naming_it(small_edge: SmallEdge) -> None:
    assert small_edge.edge.grpc_address is not None
    async with grpc.aio.insecure_channel(small_edge.edge.grpc_address) as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        await stub.CreateSession(pb.CreateSessionRequest(session_id="big"), metadata=AUTH)
        for call in (
            stub.SendInput(
                pb.SendInputRequest(session_id="big", text="x" * BODY_LIMIT, request_id="r1"),
                metadata=AUTH,
            ),
            stub.PutLoadout(
                pb.PutLoadoutRequest(document_json="{" + " " * BODY_LIMIT + "}"), metadata=AUTH
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_reason(refused.value) == "PAYLOAD_TOO_LARGE"
            assert str(BODY_LIMIT) in (refused.value.details() or "")
        ok = await stub.SendInput(
            pb.SendInputRequest(session_id="big", text="ok", request_id="r2"), metadata=AUTH
        )
        assert ok.seq == 2


async def test_an_input_under_the_body_limit_but_over_the_fact_limit_is_413(
    pg_settings: Settings,
) -> None:
    """The edge takes bodies up to its limit; the ledger's fact limit still
    holds behind it, and reaches the client as 413, not a 500."""
    settings = pg_settings.with_overrides(max_fact_bytes=FACT_LIMIT)
    cluster = await start_cluster(settings)
    config = EdgeConfig(cluster.ledger_server.target, cluster.kernel_server.target)
    edge = await EdgeServer(
        settings, config, limits=ClientLimits(max_body_bytes=4 * FACT_LIMIT)
    ).start()
    try:
        await cluster.kernel.create_api_key("default", KEY, admin=True)
        async with httpx.AsyncClient(
            base_url=edge.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ) as http:
            assert (await http.post("/v1/sessions", json={"id": "s"})).status_code == 201
            refused = await http.post(
                "/v1/sessions/s/inputs", json={"text": "x" * 2 * FACT_LIMIT, "requestId": "r1"}
            )
            assert refused.status_code == 413, refused.text
            assert refused.json()["error"]["code"] == "payload_too_large"
    finally:
        await edge.stop()
        await stop_cluster(cluster)


# ------------------------------------------------------------------ runner


async def test_a_model_answer_over_the_fact_limit_does_not_wedge_the_session(
    small_edge: SmallEdge,
) -> None:
    cluster = small_edge.cluster
    runner = await RunnerServer(
        cluster.settings,
        RunnerConfig(cluster.ledger_server.target, cluster.kernel_server.target),
    ).start()
    try:
        http = small_edge.http
        assert (await http.post("/v1/sessions", json={"id": "long"})).status_code == 201
        # About four bytes a token: several times the fact limit.
        sent = await http.post(
            "/v1/sessions/long/inputs", json={"text": "/long 4000", "requestId": "r1"}
        )
        assert sent.status_code == 202, sent.text
        ledger_id = "default:long"

        async def settled() -> list[str] | None:
            kinds = [f.kind for f in await cluster.facts(ledger_id)]
            return kinds if "session_parked" in kinds or "assistant" in kinds else None

        kinds = await eventually(settled, "the long answer to settle", deadline_s=30)
        # Answered at once, cut to the limit with a note; not failed and retried.
        assert "attempt_failed" not in kinds, kinds
        answer = next(f for f in await cluster.facts(ledger_id) if f.kind == "assistant")
        assert len(json.dumps(answer.data, ensure_ascii=False).encode()) <= FACT_LIMIT
        assert "[cut: " in json.dumps(answer.data["content"])
        # Whatever became of the long answer, the next input is answered.
        again = await http.post(
            "/v1/sessions/long/inputs", json={"text": "short", "requestId": "r2"}
        )
        assert again.status_code == 202, again.text
        seq = again.json()["seq"]

        async def answered() -> bool | None:
            for fact in await cluster.facts(ledger_id):
                if fact.kind == "assistant" and seq in fact.data.get("inputSeqs", []):
                    return True
            return None

        await eventually(answered, f"an answer to input {seq}", deadline_s=30)
    finally:
        await runner.stop(grace=0.2)


# ------------------------------------------------------------------ cutting, pure


def test_a_long_answer_is_cut_to_fit_and_says_so() -> None:
    answer: dict[str, Any] = {
        "generationId": "g-1",
        "content": [{"type": "text", "text": "é" * FACT_LIMIT}],
        "toolCalls": [{"id": "c1", "name": "echo", "arguments": {"x": 1}}],
    }
    fitted = fit_fact(answer, FACT_LIMIT)
    assert fact_bytes(fitted) <= FACT_LIMIT
    assert fitted["content"][0]["text"].endswith(f"over the fact limit of {FACT_LIMIT} bytes]")
    # Ids and the call's arguments are the model's, untouched; the input is not changed.
    assert fitted["generationId"] == "g-1"
    assert fitted["toolCalls"] == answer["toolCalls"]
    assert len(answer["content"][0]["text"]) == FACT_LIMIT
    assert fit_fact({"toolCallId": "c1", "content": "ok"}, FACT_LIMIT) == {
        "toolCallId": "c1",
        "content": "ok",
    }


def test_arguments_too_large_to_keep_make_a_call_that_is_not_run() -> None:
    answer: dict[str, Any] = {
        "generationId": "g-1",
        "content": [],
        "toolCalls": [{"id": "c1", "name": "write", "arguments": {"body": "x" * 2 * FACT_LIMIT}}],
    }
    fitted = fit_fact(answer, FACT_LIMIT)
    assert fact_bytes(fitted) <= FACT_LIMIT
    call = fitted["toolCalls"][0]
    assert "arguments" not in call
    assert "not kept" in call["argumentsText"]
