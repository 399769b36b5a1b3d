"""A fact's data: decoded and validated once, refused with a reason that
names the field, and kept as sent (fields a kind does not name included)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.ledger import facts as F
from services.ledger.errors import FactTooLarge, InvalidFact, InvalidId, LedgerError

MAX_BYTES = 1 << 20
GOOD_INPUT = {"text": "hi", "requestId": "r1"}
STARTED = {"epoch": 1, "runtimeId": "rt", "attemptId": "a", "watermark": 0}
CALL = {"id": "call-1", "name": "counter", "arguments": {"key": "k"}}


def parse(kind: str, data: object) -> F.NewFact:
    text = data if isinstance(data, str) else json.dumps(data)
    return F.parse_fact(kind, text, MAX_BYTES)


# Every shape the hand-written checks refused, with the error each raised.
REFUSED: list[tuple[str, object, type[LedgerError]]] = [
    ("mystery", {}, InvalidFact),
    ("session_created", {}, InvalidFact),
    ("input", "{not json", InvalidFact),
    ("input", "[1, 2]", InvalidFact),
    ("input", '"text"', InvalidFact),
    ("input", {"requestId": "r2"}, InvalidFact),
    ("input", {"text": 5, "requestId": "r2"}, InvalidFact),
    ("input", {"text": None, "requestId": "r2"}, InvalidFact),
    ("input", {"text": "hi"}, InvalidFact),
    ("input", {"text": "hi", "requestId": 7}, InvalidFact),
    ("input", {"text": "hi", "requestId": "r/1"}, InvalidId),
    ("input", {"text": "hi", "requestId": "nl\n"}, InvalidId),
    ("input", {"text": "hi", "requestId": ""}, InvalidId),
    ("input", GOOD_INPUT | {"retryOf": 0}, InvalidFact),
    ("input", GOOD_INPUT | {"retryOf": -3}, InvalidFact),
    ("input", GOOD_INPUT | {"retryOf": True}, InvalidFact),
    ("input", GOOD_INPUT | {"retryOf": 2.0}, InvalidFact),
    ("input", GOOD_INPUT | {"retryOf": "2"}, InvalidFact),
    ("input", GOOD_INPUT | {"blobs": "b"}, InvalidFact),
    ("input", GOOD_INPUT | {"blobs": [1]}, InvalidFact),
    ("epoch_started", {"epoch": 1}, InvalidFact),
    ("epoch_started", STARTED | {"epoch": 0}, InvalidFact),
    ("epoch_started", STARTED | {"epoch": True}, InvalidFact),
    ("epoch_started", STARTED | {"watermark": -1}, InvalidFact),
    ("epoch_started", STARTED | {"runtimeId": 1}, InvalidFact),
    ("epoch_started", STARTED | {"loadoutRevision": -1}, InvalidFact),
    ("assistant", {}, InvalidFact),
    ("assistant", {"generationId": "g g"}, InvalidId),
    ("assistant", {"generationId": "g", "content": "text"}, InvalidFact),
    ("assistant", {"generationId": "g", "toolCalls": {}}, InvalidFact),
    ("assistant", {"generationId": "g", "toolCalls": ["call"]}, InvalidFact),
    ("assistant", {"generationId": "g", "toolCalls": [{"id": "c"}]}, InvalidFact),
    ("assistant", {"generationId": "g", "toolCalls": [{"name": "n"}]}, InvalidFact),
    ("assistant", {"generationId": "g", "toolCalls": [CALL | {"id": "a b"}]}, InvalidId),
    ("assistant", {"generationId": "g", "toolCalls": [CALL | {"arguments": []}]}, InvalidFact),
    ("assistant", {"generationId": "g", "toolCalls": [CALL | {"argumentsText": {}}]}, InvalidFact),
    ("assistant", {"generationId": "g", "toolCalls": [CALL, CALL]}, InvalidFact),
    ("assistant", {"generationId": "g", "inputSeqs": 3}, InvalidFact),
    ("assistant", {"generationId": "g", "inputSeqs": [1, 0]}, InvalidFact),
    ("assistant", {"generationId": "g", "inputSeqs": [True]}, InvalidFact),
    ("tool_result", {}, InvalidFact),
    ("tool_result", {"toolCallId": "c c"}, InvalidId),
    ("tool_result", {"toolCallId": "c", "isError": 1}, InvalidFact),
    ("approval_requested", {"toolCallId": "call-1", "name": "counter"}, InvalidFact),
    ("approval_requested", {"toolCallId": "c", "name": "n", "arguments": "{}"}, InvalidFact),
    ("approval_requested", {"toolCallId": "c/", "name": "n", "arguments": {}}, InvalidId),
    ("approval", {"toolCallId": "call-1", "approve": "yes", "by": "k"}, InvalidFact),
    ("approval", {"toolCallId": "call-1", "approve": True}, InvalidFact),
    ("approval", {"toolCallId": "call-1", "approve": True, "by": ""}, InvalidFact),
    ("approval", {"toolCallId": "c", "approve": True, "by": "k", "note": "x" * 5000}, InvalidFact),
    ("approval", {"toolCallId": "c", "approve": True, "by": "k", "note": 5}, InvalidFact),
    ("approval", {"toolCallId": "bad id", "approve": True, "by": "k"}, InvalidId),
    ("compaction", {"summary": "s"}, InvalidFact),
    ("compaction", {"summary": "s", "firstKept": 0}, InvalidFact),
    ("compaction", {"summary": 1, "firstKept": 2}, InvalidFact),
    ("attempt_failed", {}, InvalidFact),
    ("attempt_failed", {"error": None}, InvalidFact),
    ("session_parked", {"reason": []}, InvalidFact),
    ("compaction_failed", {"error": 3}, InvalidFact),
    ("cancelled", "[]", InvalidFact),
]


@pytest.mark.parametrize(("kind", "data", "refusal"), REFUSED)
def test_every_refused_shape_is_refused_with_its_reason(
    kind: str, data: object, refusal: type[LedgerError]
) -> None:
    with pytest.raises(LedgerError) as caught:
        parse(kind, data)
    assert type(caught.value) is refusal
    assert caught.value.reason == refusal.reason and caught.value.message


def test_a_refusal_names_the_field_by_its_path_and_the_problem() -> None:
    calls = [CALL, {"id": "call-2", "arguments": {}}]
    with pytest.raises(InvalidFact) as missing:
        parse("assistant", {"generationId": "g", "toolCalls": calls})
    assert missing.value.metadata["field"] == "toolCalls[1].name"
    assert missing.value.message == "assistant.toolCalls[1].name is required"
    with pytest.raises(InvalidFact) as wrong:
        parse("input", GOOD_INPUT | {"blobs": ["b1", 2]})
    assert wrong.value.metadata["field"] == "blobs[1]"
    assert wrong.value.message == "input.blobs[1]: expected `str`, got `int`"
    with pytest.raises(InvalidFact) as low:
        parse("compaction", {"summary": "s", "firstKept": 0})
    assert low.value.metadata["field"] == "firstKept"
    assert "firstKept" in low.value.message and ">= 1" in low.value.message


def test_too_large_counts_utf8_bytes() -> None:
    text = json.dumps({"text": "é" * 600, "requestId": "r"}, ensure_ascii=False)
    assert len(text) < 1000 < len(text.encode())
    with pytest.raises(FactTooLarge) as caught:
        F.parse_fact("input", text, 1000)
    assert caught.value.metadata["limit"] == "1000"


def test_nesting_too_deep_for_the_decoder_is_an_invalid_fact() -> None:
    # Well inside the size limit, far past any decoder's recursion limit.
    for text in ("[" * 200_000, '{"text": "x", "requestId": "r", "a": ' + "[" * 200_000):
        with pytest.raises(InvalidFact, match="nested too deeply"):
            F.parse_fact("input", text, MAX_BYTES)


def test_json_python_reads_beyond_the_standard_stays_accepted() -> None:
    # NaN, a number past a float's range and an escaped lone surrogate were
    # accepted before the stricter decoder; a runner's fact must not start
    # failing on them.
    for extra in (
        '"x": NaN',
        '"x": 1e999',
        '"x": "\\ud800"',
        '"x": 123456789012345678901234567890',
    ):
        text = '{"text": "hi", "requestId": "r", ' + extra + "}"
        assert F.parse_fact("input", text, MAX_BYTES).data.keys() == {"text", "requestId", "x"}


def test_an_empty_data_is_an_empty_object() -> None:
    assert F.parse_fact("cancelled", "", MAX_BYTES) == F.NewFact("cancelled", {})


def test_the_input_fingerprint_is_the_body_not_the_request_id() -> None:
    same = F.input_fingerprint({"text": "hi", "requestId": "a", "blobs": ["b"]})
    assert same == F.input_fingerprint({"text": "hi", "requestId": "z", "blobs": ["b"]})
    for other in (
        {"text": "hi!", "blobs": ["b"]},
        {"text": "hi", "blobs": ["c"]},
        {"text": "hi", "blobs": ["b"], "retryOf": 2},
    ):
        assert F.input_fingerprint(other) != same
    assert F.input_fingerprint({"text": "hi"}) == F.input_fingerprint({"text": "hi", "blobs": []})
    # A lone surrogate (which only Python's json reads) still has one.
    assert F.input_fingerprint({"text": "\ud800"}) == F.input_fingerprint({"text": "\ud800"})


def test_the_fact_records_are_frozen_values() -> None:
    fact = F.CommittedFact(session_id="s", seq=1, kind="input", data={}, timestamp_ms=5, epoch=0)
    assert fact == F.CommittedFact("s", 1, "input", {}, 5, 0)
    with pytest.raises(AttributeError):
        fact.seq = 2  # type: ignore[misc]
    assert F.NewFact("input", GOOD_INPUT) == F.NewFact(kind="input", data=GOOD_INPUT)


# -- properties --

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,30}", fullmatch=True)
positive = st.integers(min_value=1, max_value=(1 << 63) - 1)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
objects = st.dictionaries(st.text(max_size=8), json_values, max_size=3)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"id": ids, "name": st.text(max_size=12)},
        optional={"arguments": objects, "argumentsText": st.text(max_size=12)},
    ),
    max_size=4,
    unique_by=lambda call: call["id"],
)
# The fields each kind must have, and may have, with valid values.
SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "input": (
        {"text": st.text(), "requestId": ids},
        {
            "retryOf": st.none() | positive,
            "blobs": st.none() | st.lists(st.text(max_size=20)),
            "multitask": st.none() | st.sampled_from(F.MULTITASK_MODES),
        },
    ),
    "epoch_started": (
        {
            "epoch": positive,
            "runtimeId": st.text(max_size=12),
            "attemptId": st.text(max_size=12),
            "watermark": st.integers(min_value=0),
        },
        {"loadoutRevision": st.none() | st.integers(min_value=0)},
    ),
    "assistant": (
        {"generationId": ids},
        {
            "content": st.none() | st.lists(json_values, max_size=3),
            "toolCalls": st.none() | tool_calls,
            "inputSeqs": st.none() | st.lists(positive, max_size=4),
        },
    ),
    "tool_result": ({"toolCallId": ids}, {"isError": st.none() | st.booleans()}),
    "approval_requested": ({"toolCallId": ids, "name": st.text(), "arguments": objects}, {}),
    "approval": (
        {"toolCallId": ids, "approve": st.booleans(), "by": st.text(min_size=1)},
        {"note": st.none() | st.text(max_size=F.MAX_APPROVAL_NOTE_CHARS)},
    ),
    "compaction": ({"summary": st.text(), "firstKept": positive}, {}),
    "attempt_failed": ({"error": st.text()}, {}),
    "cancelled": ({}, {"reason": st.none() | st.text(), "requestId": st.none() | ids}),
    "session_parked": (
        {"reason": st.text()},
        {"inputSeqs": st.none() | st.lists(positive, max_size=4)},
    ),
    "compaction_failed": ({"error": st.text()}, {}),
    "inputs_skipped": (
        {"inputSeqs": st.lists(positive, min_size=1, max_size=4), "reason": st.text()},
        {},
    ),
}
assert set(SHAPES) == F.APPENDABLE_KINDS


@st.composite
def valid_facts(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(sorted(SHAPES)))
    required, optional = SHAPES[kind]
    known = set(required) | set(optional)
    data = draw(st.fixed_dictionaries(required, optional=optional))
    # Fields a kind does not name travel with it (an input's traceparent).
    extra = draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in known), json_values))
    return kind, extra | data


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(valid_facts(), st.booleans())
def test_a_valid_fact_is_kept_as_sent(fact: tuple[str, dict[str, Any]], ascii_only: bool) -> None:
    kind, data = fact
    parsed = F.parse_fact(kind, json.dumps(data, ensure_ascii=ascii_only), MAX_BYTES)
    assert parsed == F.NewFact(kind, data)


# Values of the wrong type for each required field.
WRONG: dict[type, Any] = {
    str: st.none() | st.integers() | st.booleans() | st.lists(st.text(), max_size=2),
    int: st.none() | st.text(max_size=4) | st.booleans() | st.floats(allow_nan=False),
    bool: st.none() | st.integers() | st.text(max_size=4),
    dict: st.none() | st.integers() | st.text(max_size=4) | st.lists(st.integers(), max_size=2),
    list: st.none()
    | st.integers()
    | st.text(max_size=4)
    | st.lists(st.text(min_size=1), min_size=1),
}
FIELD_TYPES: dict[str, type] = {
    "text": str,
    "requestId": str,
    "epoch": int,
    "runtimeId": str,
    "attemptId": str,
    "watermark": int,
    "generationId": str,
    "toolCallId": str,
    "name": str,
    "arguments": dict,
    "approve": bool,
    "by": str,
    "summary": str,
    "firstKept": int,
    "error": str,
    "reason": str,
    "inputSeqs": list,
}


@st.composite
def broken_facts(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind, data = draw(valid_facts().filter(lambda fact: SHAPES[fact[0]][0]))
    field = draw(st.sampled_from(sorted(SHAPES[kind][0])))
    if draw(st.booleans()):
        del data[field]
    else:
        data[field] = draw(WRONG[FIELD_TYPES[field]])
    return kind, data


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(broken_facts())
def test_a_fact_missing_a_field_or_with_a_wrong_type_is_refused(
    fact: tuple[str, dict[str, Any]],
) -> None:
    kind, data = fact
    with pytest.raises((InvalidFact, InvalidId)):
        parse(kind, data)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([*sorted(F.APPENDABLE_KINDS), "session_created", ""]),
    st.one_of(
        st.text(max_size=60).map(lambda text: ("text", text)),
        json_values.map(lambda value: ("json", value)),
        valid_facts().map(lambda fact: ("json", fact[1])),
    ),
)
def test_anything_is_either_a_fact_or_refused_as_one(kind: str, sent: tuple[str, Any]) -> None:
    how, value = sent
    text = value if how == "text" else json.dumps(value)
    try:
        F.parse_fact(kind, text, MAX_BYTES)
    except (InvalidFact, InvalidId) as refused:
        assert refused.message
