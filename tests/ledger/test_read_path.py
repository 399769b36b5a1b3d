"""Reads straight from the stored rows give exactly what the mapper gave.

The reference below is the read path as it was: every row through the
eventsourcing mapper into a domain event, the fact's data encoded again for
the wire with `json.dumps`, and decoded by the client with `json.loads`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from keel.ledger.v1 import ledger_pb2 as pb
from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer, SessionNotFound
from services.ledger import facts as F
from services.ledger.codec import fact_from_pb, fact_to_pb, read_response
from services.ledger.domain import to_committed
from services.ledger.store import LedgerStore

SESSION = "read-path"

TEXTS = [
    "plain",
    "accents: é à ü ñ ø, ligature ﬁ, Ǆ",
    "CJK 数据模型 한국어 日本語テキスト",
    "emoji 🚀👩‍💻🏳️‍🌈 and a supplementary-plane 𝄞",
    'quotes " and \\ backslashes \\" and / slashes',
    "control \u0001\u001f chars, tab\t, newline\n, return\r",
    "right-to-left שלום مرحبا",
    "\u2028 line and \u2029 paragraph separators",
    "",
]


def _new(kind: str, data: dict[str, Any]) -> F.NewFact:
    return F.NewFact(kind, data)


def write_session(store: LedgerStore) -> None:
    """Many appends, every kind of fact the runner and clients write, over
    several epochs, with every kind of text a model or a person sends."""
    store.create_session(SESSION, "tenant-ü")
    for turn, text in enumerate(TEXTS * 3, 1):
        store.append(SESSION, [_new(F.INPUT, {"text": text, "requestId": f"r{turn}"})], 0)
        head = store.head(SESSION)
        runner = [
            _new(
                F.EPOCH_STARTED,
                {"epoch": turn, "runtimeId": "rt", "attemptId": f"a{turn}", "watermark": head},
            )
        ]
        call = {
            "id": f"c{turn}",
            "name": "search",
            "arguments": {
                "q": text,
                "limit": 10**20 + turn,
                "ratio": 0.1 + turn / 3,
                "tiny": 5e-324,
                "negative": -0.0,
                "flags": [True, False, None],
                "nested": {"ключ": {"深": [[], {}, [1, [2, [3]]]]}},
            },
        }
        runner.append(
            _new(
                F.ASSISTANT,
                {
                    "generationId": f"gen-{turn}",
                    "content": [{"type": "text", "text": f"looking up {text}"}],
                    "toolCalls": [call],
                    "usage": {"input": 100 * turn, "output": 7, "totalTokens": 100 * turn + 7},
                    "stopReason": "toolUse",
                },
            )
        )
        runner.append(
            _new(F.TOOL_RESULT, {"toolCallId": call["id"], "content": text * 3, "isError": False})
        )
        runner.append(
            _new(
                F.ASSISTANT,
                {
                    "generationId": f"gen-{turn}-final",
                    "content": [
                        {"type": "thinking", "thinking": text},
                        {"type": "text", "text": text},
                    ],
                    "toolCalls": [],
                    "inputSeqs": [head],
                    "stopReason": "stop",
                },
            )
        )
        if turn % 7 == 0:
            runner.append(_new(F.COMPACTION, {"summary": f"so far: {text}", "firstKept": head}))
        store.append(SESSION, runner, turn)
    store.append(SESSION, [_new(F.CANCELLED, {})], 0)


def mapper_facts(store: LedgerStore) -> list[F.CommittedFact]:
    return [to_committed(SESSION, event) for event in store.app.events.get(SESSION)]


def json_dumps_to_pb(fact: F.CommittedFact) -> pb.Fact:
    return pb.Fact(
        session_id=fact.session_id,
        seq=fact.seq,
        kind=fact.kind,
        data_json=json.dumps(fact.data, ensure_ascii=False, separators=(",", ":")),
        timestamp_ms=fact.timestamp_ms,
        epoch=fact.epoch,
    )


def same_fact(read: F.CommittedFact, reference: F.CommittedFact) -> None:
    assert (read.session_id, read.seq, read.kind) == (
        reference.session_id,
        reference.seq,
        reference.kind,
    )
    assert (read.timestamp_ms, read.epoch) == (reference.timestamp_ms, reference.epoch)
    assert dict(read.data) == dict(reference.data)
    # The same bytes on the wire as the reference encoding.
    assert fact_to_pb(read).SerializeToString() == json_dumps_to_pb(reference).SerializeToString()


@pytest.fixture
def store(settings: Settings) -> Any:
    ledger_store = LedgerStore(settings)
    try:
        write_session(ledger_store)
        yield ledger_store
    finally:
        ledger_store.close()


def test_pages_hold_exactly_the_mappers_facts(store: LedgerStore) -> None:
    reference = mapper_facts(store)
    assert len(reference) > 100
    for limit in (1, 7, 1000):
        read: list[F.CommittedFact] = []
        after = 0
        while True:
            page, head = store.read_page(SESSION, after, limit)
            assert head == reference[-1].seq
            read.extend(page)
            if not page or page[-1].seq >= head:
                break
            assert len(page) == limit
            after = page[-1].seq
        assert len(read) == len(reference)
        for fact, expected in zip(read, reference, strict=True):
            same_fact(fact, expected)
    subscribed = store.read(SESSION, 10, 25)
    assert [f.seq for f in subscribed] == list(range(11, 36))
    for fact in subscribed:
        same_fact(fact, reference[fact.seq - 1])


def test_a_read_response_is_built_as_from_single_facts(store: LedgerStore) -> None:
    facts, head = store.read_page(SESSION, 0, 1000)
    expected = pb.ReadResponse(facts=[json_dumps_to_pb(f) for f in mapper_facts(store)])
    expected.head_seq = head
    assert read_response(facts, head).SerializeToString() == expected.SerializeToString()
    assert read_response([], 7) == pb.ReadResponse(head_seq=7)


def test_the_head_and_missing_sessions(store: LedgerStore) -> None:
    head = mapper_facts(store)[-1].seq
    assert store.head(SESSION) == head
    assert store.exists(SESSION)
    assert store.read_page(SESSION, head, 10) == ([], head)
    assert store.read_page(SESSION, head + 50, 10) == ([], head)
    assert store.read(SESSION, head, 10) == []
    assert store.head("nobody") == 0
    assert not store.exists("nobody")
    with pytest.raises(SessionNotFound):
        store.read_page("nobody", 0, 10)


def test_data_shaped_like_a_transcoded_value_reads_back_as_written(store: LedgerStore) -> None:
    """The mapper turned any object of exactly these two keys into a
    datetime (or refused it), so such a fact made its session unreadable."""
    look_alike = {"_type_": "datetime_iso", "_data_": "2026-01-01T00:00:00+00:00"}
    unknown = {"_type_": "no_such_transcoding", "_data_": 1}
    data = {"text": "x", "requestId": "lookalike", "meta": look_alike, "other": [unknown]}
    seq = store.append(SESSION, [_new(F.INPUT, data)], 0)[0].seq
    [fact] = store.read(SESSION, seq - 1, 1)
    assert dict(fact.data) == data
    assert json.loads(fact_to_pb(fact).data_json) == data


def test_rows_msgspec_refuses_are_read_through_the_mapper(store: LedgerStore) -> None:
    # Python's json accepts these on append; the stored JSON holds NaN and
    # Infinity, which msgspec does not read.
    data_json = '{"text":"odd numbers","requestId":"nan","scores":[NaN,Infinity,-Infinity,1e400]}'
    fact = F.parse_fact(F.INPUT, data_json, 1 << 20)
    seq = store.append(SESSION, [fact], 0)[0].seq
    [read] = store.read(SESSION, seq - 1, 1)
    [expected] = [f for f in mapper_facts(store) if f.seq == seq]
    assert read.timestamp_ms == expected.timestamp_ms
    sent = fact_to_pb(read).data_json
    assert sent == json_dumps_to_pb(expected).data_json
    scores = fact_from_pb(fact_to_pb(read)).data["scores"]
    assert math.isnan(scores[0]) and scores[1:] == [math.inf, -math.inf, math.inf]


@pytest.mark.parametrize(
    "data_json",
    [
        '{"a":123456789012345678901234567890,"b":-9223372036854775809}',
        '{"a":1.0000000000000002,"b":5e-324,"c":-0.0,"d":-0,"e":1E5}',
        '{"a":"\\ud83d\\ude80 \\u00e9","b":"数据","c":"\\u0000"}',
        '{"lone":"\\ud800"}',
        '{"a":NaN}',
        '{"dup":1,"dup":2}',
        "",
    ],
)
def test_the_client_decodes_data_as_json_loads_does(data_json: str) -> None:
    message = pb.Fact(session_id="s", seq=3, kind="input", data_json=data_json, epoch=2)
    decoded = fact_from_pb(message)
    expected = json.loads(data_json or "{}")
    assert json.dumps(decoded.data) == json.dumps(expected)
    assert [type(v) for v in decoded.data.values()] == [type(v) for v in expected.values()]
    assert (decoded.seq, decoded.kind, decoded.epoch) == (3, "input", 2)


async def test_read_all_over_grpc_returns_the_mappers_facts(settings: Settings) -> None:
    server = await LedgerServer(settings).start()
    try:
        assert server.store is not None
        write_session(server.store)
        reference = mapper_facts(server.store)
        async with LedgerClient(server.target, settings) as client:
            read = await client.read_all(SESSION)
            tail = await client.read_all(SESSION, after_seq=30)
        assert len(read) == len(reference)
        for fact, expected in zip(read, reference, strict=True):
            assert fact == F.CommittedFact(
                expected.session_id,
                expected.seq,
                expected.kind,
                json.loads(json_dumps_to_pb(expected).data_json),
                expected.timestamp_ms,
                expected.epoch,
            )
            assert type(fact.data) is dict
        assert [f.seq for f in tail] == [f.seq for f in reference[30:]]
    finally:
        await server.stop(grace=0.5)
