"""The attack of issue 24, point 1, at its own scale: 100 connections, each
sending 5 MB of a header line that never ends, to a real `keel up`, with no
key. Before the head limit, the edge buffered them all and grew from 105 MB
to 590 MB in 2.4 s; now each connection is closed once its head passes the
limit (tens of KB) and what follows is dropped unread, so the edge's memory
stays about where it was, and a
well-behaved client is served throughout. The 431 itself, and its body, are
tests/edge/test_head_limits.py.

Memory is read from the `keel up` process (`VmRSS`), before and after. What
an uncapped edge would keep (100 x 5 MB) is ten times the bound asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest

from tests.support.keel_up import RunningKeel, keel_up

pytestmark = pytest.mark.slow

KEY = "head-memory-test-key-0123456789"
CONNECTIONS = 100
EACH_BYTES = 5 * 1024 * 1024
CHUNK = 64 * 1024
# An edge that kept every head would grow by 500 MB.
MAX_GROWTH_BYTES = 50 * 1024 * 1024
DEADLINE_S = 60.0


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


async def attack(port: int) -> bytes:
    """Streams one endless header line of EACH_BYTES, then reads what the
    edge answered until it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    try:
        writer.write(b"GET /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ")
        # The edge reads and drops what follows a refused head (closing
        # at once would reset the connection and could lose the answer).
        for _ in range(EACH_BYTES // CHUNK):
            writer.write(b"a" * CHUNK)
            await writer.drain()
        async with asyncio.timeout(DEADLINE_S):
            while chunk := await reader.read(65536):
                received += chunk
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return received


async def served(keel: RunningKeel) -> None:
    async with httpx.AsyncClient(base_url=keel.url, timeout=DEADLINE_S) as http:
        answer = await http.get("/v1/sessions", headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200, answer.text


async def test_a_hundred_endless_heads_do_not_grow_the_edge(tmp_path: Path) -> None:
    with keel_up(tmp_path / "data", KEY) as keel:
        port = int(keel.url.rsplit(":", 1)[1])
        pid = keel.child.proc.pid
        await served(keel)
        before = resident_bytes(pid)
        attackers = [asyncio.create_task(attack(port)) for _ in range(CONNECTIONS)]
        await served(keel)
        answers = await asyncio.gather(*attackers)
        grown = resident_bytes(pid) - before
        await served(keel)
    # Each was refused (not timed out: a 408 would mean it went uncounted).
    assert all(a.startswith(b"HTTP/1.1 431 ") for a in answers), {a[:40] for a in answers}
    assert grown < MAX_GROWTH_BYTES, f"the edge grew by {grown / 2**20:.0f} MB"
