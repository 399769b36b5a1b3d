"""A request's head has a size limit on both front doors.

Attacks reproduced: 100 connections each sending megabytes of headers that
never end grew the edge by hundreds of MB; one request with a 1 MB header, or
with 20,000 headers, was answered 200. Now a head past `max_head_bytes` (or
with more than `max_headers` lines) is answered 431 and its connection closed,
as soon as it passes the limit, whether it ever ends or not; over gRPC,
metadata past the same limit is RESOURCE_EXHAUSTED. Meanwhile a request with
large but reasonable headers is served on both doors.

The edge's header timeout is left at its default (10 s) while every attacker
keeps its head unfinished: a 408 would mean the size went uncounted until
the deadline. The deadlines below only fail a hung test.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from edge.limits import ClientLimits
from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from tests.support.edge_stack import ADMIN_KEY, DEADLINE_S, Stack
from tests.support.slow_clients import RawClient, limited_edge, request_head, status_of

LIMITS = ClientLimits()
HEAD_LIMIT = LIMITS.max_head_bytes
ATTACKERS = 20


def _refusal(answer: bytes) -> dict[str, str]:
    assert status_of(answer) == 431, answer[:300]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    assert b"x-content-type-options: nosniff" in head.lower()
    error: dict[str, str] = json.loads(body)["error"]
    assert error["code"] == "request_header_fields_too_large", error
    return error


async def _served(stack: Stack) -> None:
    """A request with big but reasonable headers (a fat cookie, 60 lines)."""
    extra = {f"X-Fine-{i}": "v" * 40 for i in range(60)}
    extra["Cookie"] = "c=" + "x" * 8000
    response = await stack.http.get("/v1/sessions", headers=extra)
    assert response.status_code == 200, response.text


async def test_a_complete_head_with_a_huge_header_is_refused_431(stack: Stack) -> None:
    client = await RawClient.connect(stack.edge.port)
    await client.send(request_head("GET", "/v1/sessions", ADMIN_KEY, {"X-Big": "a" * (1 << 20)}))
    error = _refusal(await client.closed_by_server(DEADLINE_S))
    assert str(HEAD_LIMIT) in error["message"]
    await _served(stack)


async def test_too_many_headers_are_refused_431(stack: Stack) -> None:
    # 20,000 small ones (far past the size too), and just over the count
    # limit while far within the size.
    for count in (20_000, LIMITS.max_headers + 1):
        client = await RawClient.connect(stack.edge.port)
        lines = {f"X-H{i}": "1" for i in range(count)}
        head = request_head("GET", "/v1/sessions", ADMIN_KEY, lines)
        if count < 1000:
            assert len(head) < HEAD_LIMIT // 4
        await client.send(head)
        error = _refusal(await client.closed_by_server(DEADLINE_S))
        assert "header lines" in error["message"] or str(HEAD_LIMIT) in error["message"]
    # At the limit (Host and Authorization count), a request like any other.
    client = await RawClient.connect(stack.edge.port)
    at_limit = {f"X-H{i}": "1" for i in range(LIMITS.max_headers - 2)}
    await client.send(request_head("GET", "/v1/sessions", ADMIN_KEY, at_limit))
    assert status_of(await client.read_head(DEADLINE_S)) == 200
    await client.close()


async def test_an_unfinished_head_is_cut_off_once_past_the_limit(stack: Stack) -> None:
    """Heads that never end, streamed well past the limit: each is answered
    431 and closed while its client is still sending, long before the header
    timeout; a well-behaved client is served meanwhile."""
    attackers = [await RawClient.connect(stack.edge.port) for _ in range(ATTACKERS)]
    for attacker in attackers:
        await attacker.send(b"GET /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ")
        # Eight times the limit in all, and never the line's end.
        for _ in range(8):
            await attacker.send(b"a" * HEAD_LIMIT)
        attacker.trickle(b"a" * 1024, every_s=0.05)
    await _served(stack)
    answers = await asyncio.gather(*(a.closed_by_server(DEADLINE_S) for a in attackers))
    for answer in answers:
        _refusal(answer)
    # An unfinished URL, and an unfinished header line after many complete ones.
    url = await RawClient.connect(stack.edge.port)
    await url.send(b"GET /" + b"u" * (2 * HEAD_LIMIT))
    many = await RawClient.connect(stack.edge.port)
    await many.send(
        b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 300) for i in range(99))
    )
    for client in (url, many):
        client.trickle(b"x" * 1024, every_s=0.05)
        _refusal(await client.closed_by_server(DEADLINE_S))
    await _served(stack)


def _metadata(extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {ADMIN_KEY}"), *extra]


@pytest.mark.parametrize(
    "extra",
    [
        [("x-big", "a" * (1 << 20))],
        [(f"x-h{i}", "1") for i in range(20_000)],
        [("x-big", "a" * (HEAD_LIMIT + 1))],
    ],
    ids=["1MB-value", "20000-entries", "just-past-the-limit"],
)
async def test_grpc_metadata_past_the_limit_is_refused(
    stack: Stack, extra: list[tuple[str, str]]
) -> None:
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListSessions(
                pb.ListSessionsRequest(), metadata=_metadata(extra), timeout=DEADLINE_S
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        # The door still serves, and serves metadata within the limit every
        # time (gRPC's defaults refused 8-16 KiB at random, and all above).
        for size in (10_000, 14_000, 20_000, HEAD_LIMIT - 1024):
            answer = await stub.ListSessions(
                pb.ListSessionsRequest(),
                metadata=_metadata([("x-fine", "f" * size)]),
                timeout=DEADLINE_S,
            )
            assert answer is not None


async def test_the_head_limits_are_configurable(stack: Stack) -> None:
    """KEEL_EDGE_MAX_HEAD_BYTES and KEEL_EDGE_MAX_HEADERS set them."""
    limits = ClientLimits.from_env(
        {"KEEL_EDGE_MAX_HEAD_BYTES": str(4 * HEAD_LIMIT), "KEEL_EDGE_MAX_HEADERS": "12"}
    )
    with pytest.raises(ValueError, match="KEEL_EDGE_MAX_HEADERS"):
        ClientLimits.from_env({"KEEL_EDGE_MAX_HEADERS": "0"})
    async with limited_edge(stack, limits) as edge:
        async with stack.client(ADMIN_KEY) as http:
            http.base_url = httpx.URL(edge.url)
            big = await http.get("/v1/sessions", headers={"X-Big": "a" * (2 * HEAD_LIMIT)})
            assert big.status_code == 200, big.text
        client = await RawClient.connect(edge.port)
        await client.send(
            request_head("GET", "/v1/sessions", ADMIN_KEY, {f"X-{i}": "1" for i in range(12)})
        )
        assert "12 header lines" in _refusal(await client.closed_by_server(DEADLINE_S))["message"]
