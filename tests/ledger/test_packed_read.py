"""Packed pages (`ReadRequest.packed`): the same facts as `Fact` messages,
in fewer, larger pages bounded by bytes; a request without the flag is
answered as before.

Through a real ledger on loopback, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from keel.ledger.v1 import ledger_pb2 as pb
from keel.ledger.v1 import ledger_pb2_grpc as pb_grpc
from services.common.config import Settings
from services.common.serving import MESSAGE_OVERHEAD_BYTES, open_channel
from services.ledger import FactToAppend, LedgerClient, LedgerServer
from services.ledger import facts as F
from services.ledger.codec import fact_from_pb
from services.ledger.facts import CommittedFact
from services.ledger.packed_facts import facts_from_packed
from tests.support.cluster import running_ledger

# JSON values a client may put in a fact's extra fields: every scalar the
# ledger accepts (NaN and infinities too, which json writes and msgspec
# refuses), nested a few levels. No lone surrogates: the store refuses them.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | TEXT
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
# Extra fields only: the fields an input names are the test's own.
EXTRAS = st.dictionaries(
    TEXT.filter(lambda key: key not in {"text", "requestId", "retryOf", "blobs"}), VALUES
)
SESSION_IDS = (f"packed-{n}" for n in itertools.count())


async def unpacked_all(
    client: LedgerClient, session_id: str, limit: int = F.MAX_READ_LIMIT
) -> list[CommittedFact]:
    """The session as `Fact` messages, page by page (the reference)."""
    out: list[CommittedFact] = []
    while True:
        page, head = await client.read(session_id, out[-1].seq if out else 0, limit, packed=False)
        out.extend(page)
        if not page or page[-1].seq >= head:
            return out


async def raw_read(server: LedgerServer, request: pb.ReadRequest) -> pb.ReadResponse:
    """One Read as any client sends it, the request exactly as given."""
    channel = open_channel(server.target, server.settings, [])
    try:
        return await pb_grpc.LedgerServiceStub(channel).Read(request)
    finally:
        await channel.close(None)


def same(packed: list[CommittedFact], unpacked: list[CommittedFact]) -> None:
    # repr: NaN is not equal to itself, and 1, 1.0 and True are equal.
    assert [repr(f) for f in packed] == [repr(f) for f in unpacked]


async def write(client: LedgerClient, session_id: str, inputs: list[dict[str, Any]]) -> None:
    """A session with client inputs shaped as given, and a runner's turn
    (epoch, assistant with a tool call, its result) between them."""
    await client.create_session(session_id, "tenant-1")
    for n, extra in enumerate(inputs, 1):
        data = {**extra, "text": f"input {n}", "requestId": f"r{n}"}
        head = (await client.append_one(session_id, "input", data)).seq
        call = {"id": f"c{n}", "name": "search", "arguments": extra}
        await client.append(
            session_id,
            [
                FactToAppend(
                    "epoch_started",
                    {"epoch": n, "runtimeId": "rt", "attemptId": f"a{n}", "watermark": head},
                ),
                FactToAppend(
                    "assistant",
                    {"generationId": f"g{n}", "content": [], "toolCalls": [call]},
                ),
                FactToAppend(
                    "tool_result",
                    {"toolCallId": f"c{n}", "content": json.dumps(extra), "isError": False},
                ),
            ],
            epoch=n,
        )


def test_packed_read_equals_unpacked(settings: Settings) -> None:
    """Any fact shapes: a packed read (whole, and a few facts a page) gives
    exactly the facts an unpacked read gives."""
    with asyncio.Runner() as runner:
        server = runner.run(LedgerServer(settings).start())

        async def open_client() -> LedgerClient:
            return LedgerClient(server.target, server.settings)

        client = runner.run(open_client())

        async def check(inputs: list[dict[str, Any]], limit: int) -> None:
            session_id = next(SESSION_IDS)
            await write(client, session_id, inputs)
            expected = await unpacked_all(client, session_id)
            assert len(expected) == 1 + 4 * len(inputs)
            same(await client.read_all(session_id), expected)
            paged: list[CommittedFact] = []
            while not paged or paged[-1].seq < expected[-1].seq:
                page, _ = await client.read(session_id, len(paged), limit)
                assert 0 < len(page) <= limit
                paged.extend(page)
            same(paged, expected)

        @hypothesis_settings(
            max_examples=25,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(inputs=st.lists(EXTRAS, min_size=1, max_size=4), limit=st.integers(1, 7))
        def property_holds(inputs: list[dict[str, Any]], limit: int) -> None:
            runner.run(check(inputs, limit))

        try:
            property_holds()
        finally:
            runner.run(client.close())
            runner.run(server.stop(grace=0.5))


@pytest.fixture
async def small_ledger(settings: Settings) -> AsyncIterator[LedgerServer]:
    """A ledger whose gRPC messages are as small as its facts allow."""
    small = dataclasses.replace(
        settings, max_fact_bytes=4096, grpc_max_message_bytes=4096 + MESSAGE_OVERHEAD_BYTES
    )
    async with running_ledger(small) as server:
        yield server


async def test_packed_pages_stay_within_the_message_limit(small_ledger: LedgerServer) -> None:
    """Forty 3 kB facts are ten times the message limit: a packed read
    sends them in pages under the limit (not one page the client refuses),
    each of at least one fact, and reads them all."""
    async with LedgerClient(small_ledger.target, small_ledger.settings) as client:
        await client.create_session("big", "t")
        for n in range(40):
            data = {"text": f"{n} " + "é" * 1500, "requestId": f"r{n}"}
            await client.append_one("big", "input", data)
        # (An unpacked page is bounded by its count only: one fact a page.)
        expected = await unpacked_all(client, "big", limit=1)
        assert len(expected) == 41
        same(await client.read_all("big"), expected)
        page, head = await client.read("big", 0)
        assert head == 41 and 1 <= len(page) < 41

        # A reader with a smaller limit than the ledger's says so, and a
        # fact larger than the bound still comes, alone.
        request = pb.ReadRequest(session_id="big", after_seq=3, packed=True, max_packed_bytes=1)
        response = await raw_read(small_ledger, request)
        assert not response.facts and response.head_seq == 41
        same(facts_from_packed("big", response.packed_facts), expected[3:4])


async def test_a_request_without_the_flag_is_answered_with_facts(
    ledger: LedgerServer, client: LedgerClient
) -> None:
    """An older client's request: `facts` as before, no packed page."""
    await write(client, "old", [{"k": [1, 2.5, None]}, {}])
    response = await raw_read(ledger, pb.ReadRequest(session_id="old", after_seq=0, limit=5))
    assert response.packed_facts == b""
    assert response.head_seq == 9
    old = [fact_from_pb(f) for f in response.facts]
    assert [f.seq for f in old] == [1, 2, 3, 4, 5]
    packed, head = await client.read("old", 0, 5)
    assert head == 9
    same(packed, old)
