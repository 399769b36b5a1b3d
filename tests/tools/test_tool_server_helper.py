"""keel_tools: plain functions become a ToolService.

The schema is checked at unit level; the served behaviour (results, errors,
the token, health) over a real gRPC server on loopback, called with the
generated stub as any client would.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal, Optional

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from keel.tools.v1 import tools_pb2 as pb
from keel.tools.v1 import tools_pb2_grpc as pb_grpc
from keel_tools import TOKEN_METADATA, ToolServer, define_tool, schema_of
from keel_tools.server import schema_problem
from tests.support.ports import free_port
from tests.support.processes import ChildProcess

TOKEN = "helper-test-token-0123456789"


def refund(
    order_id: str,
    amount: float,
    lines: list[int],
    reason: Literal["damaged", "late"] = "late",
    note: str | None = None,
    rush: Optional[bool] = None,  # noqa: UP045 - the older spelling must work too
    tags: dict[str, str] | None = None,
    *,
    idempotency_key: str,
    session_id: str = "",
) -> dict[str, Any]:
    """Refunds part of an order.

    Only the lines named are refunded."""
    return {}


def test_schema_from_type_hints() -> None:
    tool = define_tool(refund)
    assert tool.name == "refund"
    assert tool.description == "Refunds part of an order.\n\nOnly the lines named are refunded."
    assert tool.request_parameters == {"idempotency_key", "session_id"}
    assert tool.input_schema == {
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "amount": {"type": "number"},
            "lines": {"type": "array", "items": {"type": "integer"}},
            "reason": {"enum": ["damaged", "late"], "type": "string", "default": "late"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "rush": {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": None},
            "tags": {
                "anyOf": [
                    {"type": "object", "additionalProperties": {"type": "string"}},
                    {"type": "null"},
                ],
                "default": None,
            },
        },
        "required": ["order_id", "amount", "lines"],
        "additionalProperties": False,
    }


def test_schema_of_each_hint() -> None:
    assert schema_of(bool) == {"type": "boolean"}
    assert schema_of(int) == {"type": "integer"}
    assert schema_of(list) == {"type": "array"}
    assert schema_of(dict) == {"type": "object"}
    assert schema_of(Any) == {}
    assert schema_of(Literal[1, "a"]) == {"enum": [1, "a"]}
    assert schema_of(Annotated[int, "how many"]) == {"type": "integer", "description": "how many"}
    assert schema_of(list[dict[str, float]]) == {
        "type": "array",
        "items": {"type": "object", "additionalProperties": {"type": "number"}},
    }


def test_arguments_are_checked_against_the_schema() -> None:
    schema = define_tool(refund).input_schema["properties"]
    assert schema_problem([1, 2], schema["lines"], "lines") is None
    assert (
        schema_problem([1, "2"], schema["lines"], "lines") == 'lines[1]: expected integer, got "2"'
    )
    assert schema_problem("soon", schema["reason"], "reason") == (
        'reason: "soon" is not one of ["damaged", "late"]'
    )
    assert schema_problem(None, schema["tags"], "tags") is None
    assert schema_problem({"a": 1}, schema["tags"], "tags") is not None
    assert schema_problem(2, schema["amount"], "amount") is None  # an integer is a number


def test_functions_a_model_cannot_fill_are_refused_when_defined() -> None:
    def keyed(counts: dict[int, int]) -> str:
        return ""

    def variadic(*names: str) -> str:
        return ""

    def positional(name: str, /) -> str:
        return ""

    def opaque(when: object) -> str:
        return ""

    refused: list[tuple[Callable[..., Any], str]] = [
        (keyed, "keys are strings"),
        (variadic, r"\*names"),
        (positional, "by name"),
        (opaque, "no JSON schema"),
    ]
    for function, problem in refused:
        with pytest.raises(TypeError, match=problem):
            define_tool(function)
    with pytest.raises(ValueError, match="two tools"):
        ToolServer([keyed_ok, keyed_ok])


def keyed_ok(text: str) -> str:
    """Echoes."""
    return text


async def count_letters(word: str, *, idempotency_key: str, session_id: str) -> dict[str, Any]:
    """Counts letters (async, and told its call's key and session)."""
    return {"letters": len(word), "key": idempotency_key, "session": session_id}


def primes(limit: int) -> list[int]:
    """Primes below limit."""
    return [n for n in range(2, limit) if all(n % d for d in range(2, n))]


def fail(reason: str) -> str:
    """Fails with the reason."""
    raise ValueError(reason)


def nothing() -> None:
    """Returns nothing."""


def not_json() -> object:
    """Returns something JSON cannot carry."""
    return {1, 2}


@pytest.fixture
async def served() -> AsyncIterator[pb_grpc.ToolServiceAsyncStub]:
    server = ToolServer([keyed_ok, count_letters, primes, fail, nothing, not_json], token="")
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield pb_grpc.ToolServiceStub(channel)
    await server.stop(None)


async def _call(
    stub: pb_grpc.ToolServiceAsyncStub, name: str, arguments: dict[str, Any], **fields: Any
) -> pb.CallToolResponse:
    request = pb.CallToolRequest(name=name, arguments_json=json.dumps(arguments), **fields)
    return await stub.CallTool(request, timeout=30)


async def test_served_tools_are_listed_with_their_schemas(
    served: pb_grpc.ToolServiceAsyncStub,
) -> None:
    listed = await served.ListTools(pb.ListToolsRequest(), timeout=30)
    by_name = {tool.name: tool for tool in listed.tools}
    assert set(by_name) == {"keyed_ok", "count_letters", "primes", "fail", "nothing", "not_json"}
    assert by_name["keyed_ok"].description == "Echoes."
    schema = json.loads(by_name["count_letters"].input_schema_json)
    assert schema["properties"] == {"word": {"type": "string"}}


async def test_results_text_structured_and_request_fields(
    served: pb_grpc.ToolServiceAsyncStub,
) -> None:
    text = await _call(served, "keyed_ok", {"text": "hi"})
    assert (text.content, text.is_error, text.HasField("structured_json")) == ("hi", False, False)

    counted = await _call(
        served, "count_letters", {"word": "keel"}, idempotency_key="idem-1", session_id="s-1"
    )
    expected = {"letters": 4, "key": "idem-1", "session": "s-1"}
    assert json.loads(counted.structured_json) == expected
    assert json.loads(counted.content) == expected

    listed = await _call(served, "primes", {"limit": 10})
    assert json.loads(listed.content) == [2, 3, 5, 7]
    assert json.loads(listed.structured_json) == {"result": [2, 3, 5, 7]}

    empty = await _call(served, "nothing", {})
    assert (empty.content, empty.is_error) == ("", False)


async def test_failures_are_error_results_or_statuses(
    served: pb_grpc.ToolServiceAsyncStub,
) -> None:
    failed = await _call(served, "fail", {"reason": "the disk is full"})
    assert failed.is_error and "the disk is full" in failed.content

    unjsonable = await _call(served, "not_json", {})
    assert unjsonable.is_error and "not JSON" in unjsonable.content

    missing = await _call(served, "keyed_ok", {})
    assert missing.is_error and "missing arguments: text" in missing.content
    mistyped = await _call(served, "keyed_ok", {"text": 3})
    assert mistyped.is_error and "text: expected string, got 3" in mistyped.content
    boolean = await _call(served, "primes", {"limit": True})
    assert boolean.is_error and "limit: expected integer, got true" in boolean.content
    extra = await _call(served, "keyed_ok", {"text": "a", "idempotency_key": "forged"})
    assert extra.is_error and "idempotency_key" in extra.content

    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await _call(served, "nope", {})
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as garbled:
        await served.CallTool(pb.CallToolRequest(name="keyed_ok", arguments_json="{"), timeout=30)
    assert garbled.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_the_token_guards_tools_but_not_health(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_TOOL_TOKEN", TOKEN)
    server = ToolServer([keyed_ok])  # the token comes from the environment
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.ToolServiceStub(channel)
            for metadata in [(), ((TOKEN_METADATA, "wrong"),)]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ListTools(pb.ListToolsRequest(), timeout=30, metadata=metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            good = ((TOKEN_METADATA, TOKEN),)
            listed = await stub.ListTools(pb.ListToolsRequest(), timeout=30, metadata=good)
            assert [tool.name for tool in listed.tools] == ["keyed_ok"]

            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(
                health_pb2.HealthCheckRequest(service="keel.tools.v1.ToolService"), timeout=30
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


SERVED_BY_A_USER = """
from keel_tools import serve_tools

def add(a: int, b: int = 1) -> int:
    \"\"\"Adds two numbers.\"\"\"
    return a + b

serve_tools([add], port={port})
"""


async def test_serve_tools_runs_a_service_in_a_few_lines() -> None:
    port = free_port()
    env = {**os.environ, "KEEL_TOOL_TOKEN": TOKEN}
    child = ChildProcess.python("-c", SERVED_BY_A_USER.format(port=port), env=env)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ToolServiceStub(channel)
            metadata = ((TOKEN_METADATA, TOKEN),)
            # wait_for_ready: the call waits (up to its deadline) for the child to listen.
            listed = await stub.ListTools(
                pb.ListToolsRequest(), timeout=30, metadata=metadata, wait_for_ready=True
            )
            assert [(tool.name, tool.description) for tool in listed.tools] == [
                ("add", "Adds two numbers.")
            ]
            request = pb.CallToolRequest(name="add", arguments_json='{"a": 41}')
            added = await stub.CallTool(request, timeout=30, metadata=metadata)
            assert (added.content, added.is_error) == ("42", False)
    finally:
        child.kill()
