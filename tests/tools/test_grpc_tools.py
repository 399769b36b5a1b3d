"""An internal gRPC ToolService as a tool source, over real gRPC on loopback.

The service is `tests/support/tool_service.py`, a separate OS process built
with keel_tools; malformed replies come from a tiny raw gRPC server in this
test that sends what no well-behaved service would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent_io.tools.base import ToolCall
from agent_io.tools.grpc_source import GrpcSourceConfig, GrpcToolSource, ToolSourceError
from keel.tools.v1 import tools_pb2 as pb
from keel_tools import ToolServer
from tests.support.ports import free_port
from tests.support.tls import CertificateAuthority
from tests.support.tool_service import RunningToolService, launch, read_effects

pytestmark = pytest.mark.slow

TOKEN = "tool-service-test-token-0123456789"
TIMEOUT_S = 30.0


def tool_call(name: str, arguments: dict[str, Any], key: str = "idem-k", n: int = 1) -> ToolCall:
    return ToolCall(f"call-{n}", name, arguments, idempotency_key=key, session_id="session-1")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningToolService]:
    running = launch(tmp_path_factory.mktemp("tools") / "effects.json", token=TOKEN)
    yield running
    running.stop()


@pytest.fixture
async def source(service: RunningToolService) -> AsyncIterator[GrpcToolSource]:
    tools = GrpcToolSource(GrpcSourceConfig("billing", service.address, token=TOKEN))
    yield tools
    await tools.aclose()


async def test_lists_the_tools_once_with_their_schemas(source: GrpcToolSource) -> None:
    specs = await source.list_tools()
    by_name = {spec.name: spec for spec in specs}
    assert set(by_name) == {"echo", "apply", "slow", "big", "boom", "die"}
    assert by_name["echo"].description == "Returns the text it was given."
    assert by_name["echo"].parameters["required"] == ["text"]
    assert "idempotency_key" not in by_name["apply"].parameters["properties"]
    assert await source.list_tools() is specs  # cached for this instance


async def test_calls_return_text_and_structured_results(source: GrpcToolSource) -> None:
    echoed = await source.call(tool_call("echo", {"text": "hello"}), TIMEOUT_S)
    assert (echoed.content, echoed.is_error, echoed.structured) == ("hello", False, None)

    applied = await source.call(tool_call("apply", {"key": "structured"}, "idem-s"), TIMEOUT_S)
    assert not applied.is_error
    assert applied.structured == {"key": "structured", "count": 1, "applied": True}
    assert json.loads(applied.content) == applied.structured

    big = await source.call(tool_call("big", {"size": 5_000_000}), TIMEOUT_S)
    assert not big.is_error and len(big.content) == 5_000_000


async def test_a_repeated_idempotency_key_applies_the_effect_once(
    source: GrpcToolSource, service: RunningToolService
) -> None:
    key = "idem-repeated-0001"
    first = await source.call(tool_call("apply", {"key": "orders"}, key), TIMEOUT_S)
    # The successor of a crashed attempt calls again with the same key.
    again = await source.call(tool_call("apply", {"key": "orders"}, key), TIMEOUT_S)
    other = await source.call(tool_call("apply", {"key": "orders"}, "idem-other-0002"), TIMEOUT_S)
    assert first.structured is not None and first.structured["applied"] is True
    assert again.structured is not None and again.structured["applied"] is False
    assert other.structured is not None and other.structured["count"] == 2
    effects = read_effects(service.effects)
    assert effects["applied"]["orders"] == 2
    assert effects["keys"].count(key) == 1
    # The service's own log shows the key and the session it came with.
    await service.process.line(lambda line: f"idempotencyKey={key} session=session-1" in line)


async def test_a_wrong_or_missing_token_is_refused(service: RunningToolService) -> None:
    for token in ("wrong-token", ""):
        tools = GrpcToolSource(GrpcSourceConfig("billing", service.address, token=token))
        try:
            with pytest.raises(ToolSourceError, match="authentication refused"):
                await tools.list_tools()
            refused = await tools.call(tool_call("echo", {"text": "x"}), TIMEOUT_S)
            assert refused.is_error
            assert "authentication refused" in refused.content
            assert "KEEL_TOOL_TOKEN" in refused.content
        finally:
            await tools.aclose()


async def test_a_timeout_is_an_error_and_the_next_call_works(source: GrpcToolSource) -> None:
    late = await source.call(tool_call("slow", {"seconds": 60}), 0.5)
    assert late.is_error and "timed out after 0.5 s" in late.content
    assert late.content.startswith("billing.slow failed")
    echoed = await source.call(tool_call("echo", {"text": "still here"}), TIMEOUT_S)
    assert (echoed.content, echoed.is_error) == ("still here", False)


async def test_a_tool_that_raises_is_an_error_with_its_message(source: GrpcToolSource) -> None:
    broke = await source.call(tool_call("boom", {}), TIMEOUT_S)
    assert broke.is_error and "boom: the tool broke on purpose" in broke.content


async def test_an_unknown_tool_is_an_error(source: GrpcToolSource) -> None:
    unknown = await source.call(tool_call("refund", {}), TIMEOUT_S)
    assert unknown.is_error and "unknown tool 'refund'" in unknown.content


async def test_cancellation_propagates(source: GrpcToolSource, service: RunningToolService) -> None:
    pending = asyncio.create_task(source.call(tool_call("slow", {"seconds": 120}), TIMEOUT_S * 4))
    await service.process.line(lambda line: line.startswith("slow started for 120 s"))
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending


async def test_a_service_killed_mid_call_is_an_error(tmp_path: Path) -> None:
    dying = launch(tmp_path / "effects.json")
    tools = GrpcToolSource(GrpcSourceConfig("billing", dying.address))
    try:
        outcome = await tools.call(tool_call("die", {}), TIMEOUT_S)
        assert outcome.is_error
        assert "billing.die failed" in outcome.content
        assert dying.process.proc.wait(timeout=TIMEOUT_S) == 3
        # The service is gone now: the next call is an error too, not a hang.
        after = await tools.call(tool_call("echo", {"text": "x"}), TIMEOUT_S)
        assert after.is_error and "unreachable" in after.content
    finally:
        await tools.aclose()
        dying.stop()


async def test_an_unreachable_target_is_an_error() -> None:
    target = f"127.0.0.1:{free_port()}"
    tools = GrpcToolSource(GrpcSourceConfig("billing", target))
    try:
        outcome = await tools.call(tool_call("echo", {"text": "x"}), TIMEOUT_S)
        assert outcome.is_error and "unreachable" in outcome.content and target in outcome.content
        with pytest.raises(ToolSourceError, match="unreachable"):
            await tools.list_tools()
    finally:
        await tools.aclose()


async def test_a_closed_source_answers_with_an_error(source: GrpcToolSource) -> None:
    await source.aclose()
    outcome = await source.call(tool_call("echo", {"text": "x"}), TIMEOUT_S)
    assert outcome.is_error and "closed" in outcome.content


@contextlib.asynccontextmanager
async def raw_service(
    list_reply: bytes, call_reply: Callable[[pb.CallToolRequest], bytes]
) -> AsyncIterator[str]:
    """A ToolService that sends the given bytes as its replies, as they are."""

    async def list_tools(request: pb.ListToolsRequest, context: Any) -> bytes:
        return list_reply

    async def call_tool(request: pb.CallToolRequest, context: Any) -> bytes:
        return call_reply(request)

    handlers = {
        "ListTools": grpc.unary_unary_rpc_method_handler(
            list_tools,
            request_deserializer=pb.ListToolsRequest.FromString,
            response_serializer=bytes,
        ),
        "CallTool": grpc.unary_unary_rpc_method_handler(
            call_tool,
            request_deserializer=pb.CallToolRequest.FromString,
            response_serializer=bytes,
        ),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("keel.tools.v1.ToolService", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def malformed_call_reply(request: pb.CallToolRequest) -> bytes:
    replies = {
        "bad_json": pb.CallToolResponse(content="ok", structured_json="{not json"),
        "not_object": pb.CallToolResponse(content="ok", structured_json="[1, 2]"),
    }
    if request.name in replies:
        return replies[request.name].SerializeToString()
    return b"\xff\xff\xff\xff not a protobuf message"


async def test_malformed_replies_are_errors() -> None:
    bad_schema = pb.ListToolsResponse(tools=[pb.Tool(name="x", input_schema_json="nope")])
    async with raw_service(bad_schema.SerializeToString(), malformed_call_reply) as address:
        tools = GrpcToolSource(GrpcSourceConfig("broken", address))
        try:
            with pytest.raises(ToolSourceError, match="input_schema_json is not JSON"):
                await tools.list_tools()
            for name, problem in [
                ("bad_json", "structured_json is not JSON"),
                ("not_object", "structured_json is not a JSON object"),
                ("garbage", "malformed reply"),
            ]:
                outcome = await tools.call(tool_call(name, {}), TIMEOUT_S)
                assert outcome.is_error, name
                assert problem in outcome.content, outcome.content
        finally:
            await tools.aclose()


def shout(text: str) -> str:
    """Upper-cases the text."""
    return text.upper()


async def test_tls_targets_verify_the_service_certificate(tmp_path: Path) -> None:
    authority = CertificateAuthority("tool-ca", tmp_path / "tls")
    issued = authority.issue("tools", hosts=("127.0.0.1",))
    credentials = grpc.ssl_server_credentials([(issued.key.read_bytes(), issued.cert.read_bytes())])
    server = ToolServer([shout], token="")
    port = await server.start("127.0.0.1", 0, credentials)
    target = f"grpcs://127.0.0.1:{port}"
    trusting = GrpcToolSource(GrpcSourceConfig("secure", target, tls_ca_file=str(authority.pem)))
    # Without our CA, only the system roots: the test CA is not among them.
    strangers = GrpcToolSource(GrpcSourceConfig("secure", target, tls_ca_file=""))
    missing_ca = GrpcToolSource(
        GrpcSourceConfig("secure", target, tls_ca_file=str(tmp_path / "absent.pem"))
    )
    try:
        outcome = await trusting.call(tool_call("shout", {"text": "tls"}), TIMEOUT_S)
        assert (outcome.content, outcome.is_error) == ("TLS", False)
        refused = await strangers.call(tool_call("shout", {"text": "tls"}), TIMEOUT_S)
        assert refused.is_error and "unreachable" in refused.content
        unreadable = await missing_ca.call(tool_call("shout", {"text": "tls"}), TIMEOUT_S)
        assert unreadable.is_error and "KEEL_TOOL_TLS_CA" in unreadable.content
    finally:
        for tools in (trusting, strangers, missing_ca):
            await tools.aclose()
        await server.stop(None)
