"""Slow clients are timed out, and a client that leaves is not an error.

Attacks reproduced (with the edge's timeouts set short, 1 s, so the test is
quick; the deadlines below only fail a hung test):
- 200 connections sending their headers a line at a time (slowloris), and
  200 that send nothing at all, were all still open a minute later;
- 200 bodies trickled a byte at a time, and bodies that stop halfway, held
  their connections as long as they liked;
- every aborted body raised an unhandled `ClientDisconnect`, counted as a 500.

Meanwhile a well-behaved client is served.
"""

from __future__ import annotations

import asyncio
import re

import httpx

from edge.limits import ClientLimits
from edge.server import EdgeServer
from tests.support.edge_stack import ADMIN_KEY, DEADLINE_S, Stack
from tests.support.polling import eventually
from tests.support.slow_clients import RawClient, limited_edge, request_head, status_of

CONNECTIONS = 200
TIMEOUT_S = 1.0
LIMITS = ClientLimits(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S)
# An upper bound that fails a hung test: far above the 1 s the edge is given.
CLOSED_WITHIN_S = 30.0


async def served(edge: EdgeServer) -> None:
    """A normal client gets its answers while the attack goes on."""
    async with httpx.AsyncClient(
        base_url=edge.url,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=httpx.Timeout(DEADLINE_S),
    ) as http:
        created = await http.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        assert (await http.get(f"/v1/sessions/{created.json()['id']}")).status_code == 200


async def test_slowloris_heads_are_closed_while_others_are_served(stack: Stack) -> None:
    async with limited_edge(stack, LIMITS) as edge:
        slow = [await RawClient.connect(edge.port) for _ in range(CONNECTIONS)]
        silent = [await RawClient.connect(edge.port) for _ in range(CONNECTIONS)]
        for attacker in slow:
            await attacker.send(b"GET /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            attacker.trickle(b"X-Slow: a\r\n", every_s=0.2)

        await served(edge)

        answers = await asyncio.gather(*(c.closed_by_server(CLOSED_WITHIN_S) for c in slow))
        await asyncio.gather(*(c.closed_by_server(CLOSED_WITHIN_S) for c in silent))
        # Part of a head came: told why; nothing came: just closed.
        assert {status_of(answer) for answer in answers} == {408}
        assert all(b"x-content-type-options: nosniff" in a.lower() for a in answers)
        assert {c.received for c in silent} == {b""}

        # The edge holds none of them any more, and still serves.
        await served(edge)


async def test_a_kept_alive_connection_cannot_trickle_its_next_head(stack: Stack) -> None:
    async with limited_edge(stack, LIMITS) as edge:
        attacker = await RawClient.connect(edge.port)
        await attacker.send(request_head("GET", "/healthz"))
        assert status_of(await attacker.read_head(DEADLINE_S)) == 200
        await attacker.send(b"GET /healthz HTTP/1.1\r\n")
        attacker.trickle(b"X-Slow: a\r\n", every_s=0.2)
        assert b"408 Request Timeout" in await attacker.closed_by_server(CLOSED_WITHIN_S)


async def test_slow_and_stalled_bodies_get_408_and_are_closed(stack: Stack) -> None:
    async with limited_edge(stack, LIMITS) as edge:
        session = "slow-bodies"
        async with httpx.AsyncClient(
            base_url=edge.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ) as http:
            assert (await http.post("/v1/sessions", json={"id": session})).status_code == 201
        head = request_head(
            "POST",
            f"/v1/sessions/{session}/inputs",
            ADMIN_KEY,
            {"Content-Type": "application/json", "Content-Length": "200"},
        )
        # Never silent for a whole second, but far slower than 500 bytes/s.
        trickled = [await RawClient.connect(edge.port) for _ in range(CONNECTIONS)]
        for attacker in trickled:
            await attacker.send(head + b'{"text": "')
            attacker.trickle(b"x", every_s=0.2)
        # A body that stops halfway.
        stalled = [await RawClient.connect(edge.port) for _ in range(CONNECTIONS // 4)]
        for attacker in stalled:
            await attacker.send(head + b'{"text": "half')

        await served(edge)

        answers = await asyncio.gather(
            *(c.closed_by_server(CLOSED_WITHIN_S) for c in trickled + stalled)
        )
        assert {status_of(answer) for answer in answers} == {408}
        assert all(b'"code":"request_timeout"' in answer for answer in answers)
        # None of those bodies was committed.
        inputs = [f for f in await stack.facts(session) if f.kind == "input"]
        assert inputs == []
        await served(edge)


async def request_counts(http: httpx.AsyncClient, route: str) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    pattern = rf'^keel_edge_requests_total\{{route="{route}",status="(\d+)"\}} (\S+)$'
    return {status: float(n) for status, n in re.findall(pattern, text, re.MULTILINE)}


async def test_an_aborted_body_is_counted_as_499_not_500(stack: Stack) -> None:
    session = await stack.new_session()
    for _ in range(3):
        leaver = await RawClient.connect(stack.edge.port)
        await leaver.send(
            request_head(
                "POST",
                f"/v1/sessions/{session}/inputs",
                ADMIN_KEY,
                {"Content-Type": "application/json", "Content-Length": "100"},
            )
            + b'{"text": "gone'
        )
        await leaver.close()

    async def all_counted() -> dict[str, float] | None:
        counts = await request_counts(stack.http, "post_input")
        return counts if counts.get("499") == 3.0 else None

    counts = await eventually(all_counted, "the aborted bodies to be counted", DEADLINE_S)
    assert "500" not in counts, counts
    assert [f for f in await stack.facts(session) if f.kind == "input"] == []
