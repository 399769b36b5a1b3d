"""Request bodies: decoded once into their struct, refused with a 400 that
names the field and the problem, the same from the HTTP and gRPC doors."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge import bodies
from edge.bodies import (
    MAX_BLOBS_PER_INPUT,
    MAX_TEXT_CHARS,
    Body,
    CreateBlobBody,
    CreateKeyBody,
    CreateSessionBody,
    CreateTenantBody,
    DecisionBody,
    DrainBody,
    InputBody,
    LocalDrainBody,
    RetryBody,
    UndoDrainBody,
)
from edge.errors import BadRequest
from tests.support.edge_stack import Stack
from tests.support.http_errors import assert_error

SCHEMAS: list[type[Body]] = [
    CreateSessionBody,
    InputBody,
    RetryBody,
    DecisionBody,
    CreateTenantBody,
    CreateKeyBody,
    CreateBlobBody,
    DrainBody,
    UndoDrainBody,
    LocalDrainBody,
]


def refused(raw: bytes | dict[str, Any], schema: type[Body]) -> BadRequest:
    sent = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    with pytest.raises(BadRequest) as caught:
        bodies.decode(sent, schema)
    assert caught.value.status == 400 and caught.value.message
    return caught.value


def test_a_body_is_decoded_into_its_struct() -> None:
    body = bodies.decode(b'{"text": "hi", "requestId": "r-1", "blobs": ["b"]}', InputBody)
    assert body == InputBody(text="hi", request_id="r-1", blobs=["b"])
    # An optional field sent as null is absent, as it always was.
    assert bodies.decode(b'{"text": "hi", "requestId": null, "blobs": null}', InputBody) == (
        InputBody(text="hi")
    )
    # An empty body is {}: every default.
    assert bodies.decode(b"", CreateSessionBody) == CreateSessionBody(id=None)
    assert bodies.decode(b"", DrainBody).deadline_ms is msgspec.UNSET
    assert bodies.decode(b'{"deadlineMs": 0}', LocalDrainBody) == LocalDrainBody(deadline_ms=0)
    assert bodies.decode(b'{"length": 3}', CreateBlobBody).content_type == (
        "application/octet-stream"
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "the body is not valid JSON"),
        (b'{"text":"\xff"}', "the body is not valid JSON"),
        (b'{"text":"\\ud800"}', "the body is not valid JSON"),
        # Deep nesting is refused at its first bracket, never recursed into.
        (b"[" * 100_000, "the body must be a JSON object"),
        (b'{"text": ' + b"[" * 100_000, "text: expected `str`, got `array`"),
        (b'["text"]', "the body must be a JSON object"),
        (b'"hello"', "the body must be a JSON object"),
        (b"null", "the body must be a JSON object"),
    ],
)
def test_what_is_not_a_json_object_is_refused_as_before(raw: bytes, message: str) -> None:
    assert refused(raw, InputBody).message == message


@pytest.mark.parametrize(
    ("raw", "schema", "field", "said"),
    [
        ({}, InputBody, "text", "text is required"),
        ({"text": 5}, InputBody, "text", "text: expected `str`, got `int`"),
        ({"text": None}, InputBody, "text", "text: expected `str`, got `null`"),
        ({"text": "x" * (MAX_TEXT_CHARS + 1)}, InputBody, "text", f"<= {MAX_TEXT_CHARS}"),
        ({"text": "x", "requestId": ["r"]}, InputBody, "requestId", "requestId: expected"),
        ({"text": "x", "blobs": "b"}, InputBody, "blobs", "blobs: expected `array"),
        ({"text": "x", "blobs": ["b", 2]}, InputBody, "blobs[1]", "blobs[1]: expected `str`"),
        (
            {"text": "x", "blobs": ["b"] * (MAX_BLOBS_PER_INPUT + 1)},
            InputBody,
            "blobs",
            f"<= {MAX_BLOBS_PER_INPUT}",
        ),
        ({"seq": 0}, RetryBody, "seq", "seq: expected `int` >= 1"),
        ({"seq": True}, RetryBody, "seq", "got `bool`"),
        ({"seq": 1 << 63}, RetryBody, "seq", "seq: expected `int` <="),
        ({"seq": 1.0}, RetryBody, "seq", "got `float`"),
        ({"approve": True}, DecisionBody, "toolCallId", "toolCallId is required"),
        ({"toolCallId": "c", "approve": "yes"}, DecisionBody, "approve", "expected `bool`"),
        ({"toolCallId": "c"}, DecisionBody, "approve", "approve is required"),
        ({"toolCallId": "c", "approve": True, "note": "n" * 5000}, DecisionBody, "note", "<="),
        ({"id": 7}, CreateSessionBody, "id", "id: expected `str | null`, got `int`"),
        ({"name": "x"}, CreateTenantBody, "id", "id is required"),
        ({"id": "t", "name": None}, CreateTenantBody, "name", "got `null`"),
        ({"admin": "yes"}, CreateKeyBody, "admin", "admin: expected `bool`"),
        ({"operator": None}, CreateKeyBody, "operator", "got `null`"),
        ({"tenant": 1}, CreateKeyBody, "tenant", "tenant: expected"),
        ({"length": "3"}, CreateBlobBody, "length", "length: expected `int`, got `str`"),
        ({"length": 3, "contentType": None}, CreateBlobBody, "contentType", "got `null`"),
        ({"deadlineMs": -1}, DrainBody, "deadlineMs", "deadlineMs: expected `int` >= 0"),
        ({"deadlineMs": None}, DrainBody, "deadlineMs", "got `null`"),
        ({"mode": 3}, DrainBody, "mode", "mode: expected `str`"),
        ({"undo": 1}, LocalDrainBody, "undo", "undo: expected `bool`"),
    ],
)
def test_a_refusal_names_the_field_and_the_problem(
    raw: dict[str, Any], schema: type[Body], field: str, said: str
) -> None:
    error = refused(raw, schema)
    assert error.metadata["field"] == field, error.message
    assert said in error.message, error.message
    # The gRPC door builds the body from its message: the same refusal.
    with pytest.raises(BadRequest) as converted:
        bodies.convert(raw, schema)
    assert (converted.value.message, converted.value.metadata) == (error.message, error.metadata)


def test_an_unknown_field_is_refused_by_name_cut_short() -> None:
    error = refused({"text": "x", "requestID": "r"}, InputBody)
    fields = "blobs, multitask, requestId, text"
    assert error.message == f"unknown field 'requestID'; the fields are: {fields}"
    long = refused({"z" * 5000: 1}, CreateSessionBody).message
    assert "zzzz" in long and "z" * 65 not in long


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=70),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=70), inner),
    max_leaves=10,
)
FIELD_NAMES = sorted({name for schema in SCHEMAS for name in schema.__struct_encode_fields__})


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(SCHEMAS),
    st.one_of(
        st.binary(max_size=40),
        json_values.map(lambda value: json.dumps(value).encode()),
        st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=4).map(
            lambda value: json.dumps(value).encode()
        ),
    ),
)
def test_any_body_is_decoded_or_refused_with_a_400(schema: type[Body], raw: bytes) -> None:
    try:
        body = bodies.decode(raw, schema)
    except BadRequest as error:
        # A client's value is never quoted at length.
        assert len(error.message) < 400, error.message
        return
    assert isinstance(body, schema)
    # What is accepted is what a struct of its type would encode.
    assert bodies.decode(msgspec.json.encode(body), schema) == body


async def test_a_wrong_type_is_a_400_naming_the_field_over_http(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session()
    cases = {
        "text": await http.post(f"/v1/sessions/{session}/inputs", json={"text": ["hi"]}),
        "seq": await http.post(f"/v1/sessions/{session}/retry", json={"seq": "1"}),
        "approve": await http.post(
            f"/v1/sessions/{session}/approvals", json={"toolCallId": "c", "approve": 1}
        ),
        "admin": await http.post("/v1/keys", json={"admin": "true"}),
        "length": await http.post("/v1/blobs", json={"length": 1.5}),
        "deadlineMs": await http.post("/v1/runtime/drain", json={"deadlineMs": "soon"}),
    }
    for field, response in cases.items():
        error = assert_error(response, 400)
        assert error["code"] == "bad_request" and error["message"].startswith(field), error
    # Nothing was committed.
    assert [f.kind for f in await stack.facts(session)] == ["session_created"]
