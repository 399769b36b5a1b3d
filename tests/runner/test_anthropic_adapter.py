"""The Anthropic adapter against a real local messages-API server."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent_io.providers import (
    AnthropicMessages,
    Completed,
    ContextOverflow,
    ModelRequest,
    ProviderError,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
    provider_from_loadout,
)
from compaction.policy import message_from_dict
from services.common.secrets import SecretPolicy
from tests.support.blobs import PNG, attached
from tests.support.fault_provider import Fault, anthropic_error
from tests.support.provider_checks import collect, fault_read, hello, refused
from tests.support.provider_frames import (
    block_delta,
    block_start,
    block_stop,
    message_end,
    message_start,
    text_answer,
    tool_use_answer,
)
from tests.support.wire_servers import WireServer, event_frame, sse_reply

MODEL = "claude-test"
CLOCK = ToolSpec("clock", "Current time.", {"type": "object", "properties": {"tz": {}}})
SLEEP = ToolSpec("sleep", "Wait.", {"type": "object", "properties": {"seconds": {}}})
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture
async def server() -> AsyncIterator[WireServer]:
    async with WireServer("/v1/messages") as wire:
        yield wire


@pytest.fixture
async def provider(server: WireServer) -> AsyncIterator[AnthropicMessages]:
    adapter = AnthropicMessages(model=MODEL, api_key="test-key", base_url=server.url)
    yield adapter
    await adapter.aclose()


def sent_key(headers: dict[str, str]) -> str | None:
    """The API key a request carried (SDK versions differ on the header)."""
    if "x-api-key" in headers:
        return headers["x-api-key"]
    return headers.get("authorization", "").removeprefix("Bearer ") or None


async def test_streams_thinking_text_and_tool_use(
    server: WireServer, provider: AnthropicMessages
) -> None:
    server.queue(
        sse_reply(
            [
                message_start(25, cache_read=100, cache_write=10),
                event_frame("ping", {"type": "ping"}),
                block_start(0, {"type": "thinking", "thinking": "", "signature": ""}),
                block_delta(0, {"type": "thinking_delta", "thinking": "Need the "}),
                block_delta(0, {"type": "thinking_delta", "thinking": "time."}),
                block_delta(0, {"type": "signature_delta", "signature": "c2ln"}),
                block_stop(0),
                block_start(1, {"type": "text", "text": ""}),
                block_delta(1, {"type": "text_delta", "text": "Let me "}),
                block_delta(1, {"type": "text_delta", "text": "check."}),
                block_stop(1),
                block_start(2, {"type": "tool_use", "id": "toolu_1", "name": "clock", "input": {}}),
                block_delta(2, {"type": "input_json_delta", "partial_json": ""}),
                block_delta(2, {"type": "input_json_delta", "partial_json": '{"tz": '}),
                block_delta(2, {"type": "input_json_delta", "partial_json": '"UTC"}'}),
                block_stop(2),
                block_start(3, {"type": "tool_use", "id": "toolu_2", "name": "clock", "input": {}}),
                block_stop(3),
                *message_end("tool_use", 42),
            ]
        )
    )
    events, completed = await collect(provider, hello(tools=(CLOCK,), max_output_tokens=512))

    assert events == [
        ThinkingDelta("Need the "),
        ThinkingDelta("time."),
        TextDelta("Let me "),
        TextDelta("check."),
        ToolCallDelta(0, "toolu_1", "clock", ""),
        ToolCallDelta(0, "toolu_1", "clock", ""),
        ToolCallDelta(0, "toolu_1", "clock", '{"tz": '),
        ToolCallDelta(0, "toolu_1", "clock", '"UTC"}'),
        ToolCallDelta(1, "toolu_2", "clock", ""),
    ]
    assert completed.content == (
        {"type": "thinking", "thinking": "Need the time.", "signature": "c2ln"},
        {"type": "text", "text": "Let me check."},
    )
    assert completed.tool_calls == (
        {"id": "toolu_1", "name": "clock", "arguments": {"tz": "UTC"}},
        {"id": "toolu_2", "name": "clock", "arguments": {}},
    )
    assert completed.stop_reason == "toolUse"
    assert completed.usage == Usage(input=25, output=42, cache_read=100, cache_write=10)
    assert completed.model == "claude-test-20250101"
    assert completed.extra == {"messageId": "msg_1"}

    (received,) = server.received
    assert received.path == "/v1/messages"
    assert sent_key(received.headers) == "test-key"
    assert received.body == {
        "model": MODEL,
        "max_tokens": 512,
        "stream": True,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi", "cache_control": EPHEMERAL}],
            }
        ],
        "tools": [
            {
                "name": "clock",
                "description": "Current time.",
                "input_schema": {"type": "object", "properties": {"tz": {}}},
            }
        ],
    }


async def test_transcript_is_converted(server: WireServer, provider: AnthropicMessages) -> None:
    server.queue(sse_reply(text_answer("ok", stop_reason="max_tokens")))
    image = {"type": "image", "data": "AAAA", "mimeType": "image/jpeg"}
    messages = (
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, image]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "mine", "signature": "sig"},
                {"type": "thinking", "thinking": "another model's"},
                {"type": "thinking", "thinking": "", "redactedData": "opaque"},
                {"type": "text", "text": ""},
                {"type": "text", "text": "Checking."},
                {"type": "toolCall", "id": "call|1", "name": "clock", "arguments": {}},
                {"type": "toolCall", "id": "call_2", "name": "shot", "arguments": {"w": 2}},
            ],
        },
        {
            "role": "toolResult",
            "toolCallId": "call|1",
            "toolName": "clock",
            "content": "no clock here",
            "isError": True,
        },
        {"role": "toolResult", "toolCallId": "call_2", "toolName": "shot", "content": [image]},
        {"role": "user", "content": "And now?"},
    )
    _, completed = await collect(provider, ModelRequest(system="", messages=messages))
    assert completed.stop_reason == "length"

    wire_image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"},
    }
    body = server.received[0].body
    assert "system" not in body and "tools" not in body
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, wire_image]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "mine", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "call_1", "name": "clock", "input": {}},
                {"type": "tool_use", "id": "call_2", "name": "shot", "input": {"w": 2}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "call_1",
                    "is_error": True,
                    "content": [{"type": "text", "text": "no clock here"}],
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "call_2",
                    "is_error": False,
                    "content": [wire_image],
                },
                {"type": "text", "text": "And now?", "cache_control": EPHEMERAL},
            ],
        },
    ]


async def test_cut_off_input_is_kept_as_the_model_sent_it(
    server: WireServer, provider: AnthropicMessages
) -> None:
    # max_tokens cut the tool_use mid-input: the text is kept (never {}),
    # and the stop reason is the same "length" the OpenAI adapter gives.
    server.queue(
        sse_reply(tool_use_answer([("toolu_1", "sleep", ['{"seco', 'nds": 5'])], "max_tokens"))
    )
    events, completed = await collect(provider, hello(tools=(SLEEP,)))
    assert "".join(e.arguments_fragment for e in events if isinstance(e, ToolCallDelta)) == (
        '{"seconds": 5'
    )
    assert completed.tool_calls == (
        {"id": "toolu_1", "name": "sleep", "arguments": {}, "argumentsText": '{"seconds": 5'},
    )
    assert completed.stop_reason == "length"
    assert "invalidToolArguments" not in completed.extra


async def test_input_that_is_not_an_object_is_kept(
    server: WireServer, provider: AnthropicMessages
) -> None:
    server.queue(sse_reply(tool_use_answer([("toolu_2", "sleep", ["[5]"])])))
    _, completed = await collect(provider, hello(tools=(SLEEP,)))
    assert completed.tool_calls == (
        {"id": "toolu_2", "name": "sleep", "arguments": {}, "argumentsText": "[5]"},
    )
    assert completed.stop_reason == "toolUse"


async def test_prefixed_tool_names_travel_as_wire_names_and_come_back(
    server: WireServer, provider: AnthropicMessages
) -> None:
    read = ToolSpec("files.read", "Read a file.", {"type": "object"})
    history = (
        {"role": "user", "content": "Read a."},
        {
            "role": "assistant",
            "content": [
                {"type": "toolCall", "id": "c0", "name": "files.read", "arguments": {"p": "a"}},
                # Arguments the model once sent malformed: input must be an object.
                {"type": "toolCall", "id": "c1", "name": "files.read", "arguments": '{"p": '},
            ],
        },
        {"role": "toolResult", "toolCallId": "c0", "toolName": "files.read", "content": "A"},
        {
            "role": "toolResult",
            "toolCallId": "c1",
            "toolName": "files.read",
            "content": "not run: its arguments are not a JSON object",
            "isError": True,
        },
        {"role": "user", "content": "Now b."},
    )
    server.queue(sse_reply(tool_use_answer([("toolu_3", "files_read", ['{"p": ', '"b"}'])])))
    request = ModelRequest(system="", messages=history, tools=(read, CLOCK))
    events, completed = await collect(provider, request)

    body = server.received[0].body
    assert [tool["name"] for tool in body["tools"]] == ["files_read", "clock"]
    assert body["messages"][1]["content"] == [
        {"type": "tool_use", "id": "c0", "name": "files_read", "input": {"p": "a"}},
        {"type": "tool_use", "id": "c1", "name": "files_read", "input": {}},
    ]
    assert {e.name for e in events if isinstance(e, ToolCallDelta)} == {"files.read"}
    assert completed.tool_calls == (
        {"id": "toolu_3", "name": "files.read", "arguments": {"p": "b"}},
    )


async def test_an_inputs_blobs_become_wire_blocks_in_order(
    server: WireServer, provider: AnthropicMessages, tmp_path: Path
) -> None:
    server.queue(sse_reply(text_answer("ok")))
    notes = b'{"todo": ["oat milk"]}'
    message = attached(tmp_path, "compare", (PNG, "image/png"), (notes, "application/json"))
    await collect(provider, ModelRequest(system="", messages=(message,)))

    (user_turn,) = server.received[0].body["messages"]
    file_text = message["content"][2]["text"]
    assert file_text.endswith(":\n" + notes.decode())
    png = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
    assert user_turn == {
        "role": "user",
        "content": [
            {"type": "text", "text": "compare"},
            {"type": "image", "source": png},
            {"type": "text", "text": file_text, "cache_control": EPHEMERAL},
        ],
    }


async def test_redacted_thinking_round_trips(
    server: WireServer, provider: AnthropicMessages
) -> None:
    server.queue(
        sse_reply(
            [
                message_start(),
                block_start(0, {"type": "redacted_thinking", "data": "b3BhcXVl"}),
                block_stop(0),
                block_start(1, {"type": "text", "text": "Done."}),
                block_stop(1),
                *message_end("end_turn", 3),
            ]
        ),
        sse_reply(text_answer("again")),
    )
    events, completed = await collect(provider, hello())
    assert events == [TextDelta("Done.")]
    assert completed.content == (
        {"type": "thinking", "thinking": "", "redactedData": "b3BhcXVl"},
        {"type": "text", "text": "Done."},
    )
    # The committed message is a valid transcript message, and goes back as it came.
    assistant = {"role": "assistant", "content": list(completed.content)}
    message_from_dict(assistant)
    follow_up = (*hello().messages, assistant, {"role": "user", "content": "More"})
    await collect(provider, ModelRequest(system="", messages=follow_up))
    sent = server.received[1].body["messages"][1]["content"]
    assert sent == [
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Done."},
    ]


def api_error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


@pytest.mark.parametrize(
    ("status", "body", "overflow", "retryable"),
    [
        (429, api_error("rate_limit_error", "Number of requests exceeded"), False, True),
        (529, api_error("overloaded_error", "Overloaded"), False, True),
        (500, api_error("api_error", "Internal server error"), False, True),
        (401, api_error("authentication_error", "invalid x-api-key"), False, False),
        (
            400,
            api_error(
                "invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum"
            ),
            True,
            False,
        ),
    ],
)
async def test_http_errors_are_classified(
    server: WireServer,
    provider: AnthropicMessages,
    status: int,
    body: dict[str, Any],
    overflow: bool,
    retryable: bool,
) -> None:
    error = await refused(server, provider, status, body)
    assert isinstance(error, ContextOverflow) is overflow
    assert error.retryable is retryable


@pytest.mark.parametrize(
    ("fault", "retryable", "rate_limited", "wait_ms"),
    [
        (
            anthropic_error(429, "rate_limit_error", "Slow down.", retry_after="30"),
            True,
            True,
            30_000,
        ),
        (anthropic_error(529, "overloaded_error", "Overloaded", retry_after="4"), True, True, 4000),
        (anthropic_error(500, "api_error", "Internal", retry_after="1"), True, False, 1000),
        (anthropic_error(401, "authentication_error", "invalid x-api-key"), False, False, None),
    ],
)
async def test_rate_limits_and_retry_after_are_read(
    fault: Fault, retryable: bool, rate_limited: bool, wait_ms: int | None
) -> None:
    def adapter(url: str) -> AnthropicMessages:
        return AnthropicMessages(model=MODEL, api_key="k", base_url=url)

    read = await fault_read("/v1/messages", adapter, fault)
    assert read == (retryable, rate_limited, wait_ms)


async def test_overload_inside_the_stream_is_retryable(
    server: WireServer, provider: AnthropicMessages
) -> None:
    frames = text_answer("par")[:3]
    server.queue(sse_reply([*frames, event_frame("error", api_error("overloaded_error", "Busy"))]))
    with pytest.raises(ProviderError) as caught:
        await collect(provider, hello())
    assert caught.value.retryable
    assert not isinstance(caught.value, ContextOverflow)
    # Out of capacity, not failing; an accepted stream's headers ask no wait.
    assert caught.value.rate_limited and caught.value.retry_after_ms is None


async def test_a_cut_stream_is_not_an_answer(
    server: WireServer, provider: AnthropicMessages
) -> None:
    server.queue(sse_reply(text_answer("half an ans")[:3]))
    with pytest.raises(ProviderError) as caught:
        await collect(provider, hello())
    assert caught.value.retryable


async def test_consumer_can_stop_mid_stream(
    server: WireServer, provider: AnthropicMessages
) -> None:
    server.queue(sse_reply(text_answer(*(f"t{i} " for i in range(50))), frame_delay=0.01))
    stream = provider.stream(hello())
    assert isinstance(stream, AsyncGenerator)
    assert await anext(stream) == TextDelta("t0 ")
    await stream.aclose()


async def test_loadout_builds_the_adapter(server: WireServer) -> None:
    # The operator allows the test's server and grants the variable to the
    # tenant; the runner refuses both otherwise.
    policy = SecretPolicy().with_grant("acme", "TEST_ANTHROPIC_KEY").with_origin(server.url)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    adapter = provider_from_loadout(
        {
            "provider": "anthropic",
            "name": MODEL,
            "baseUrl": server.url,
            "apiKeyEnv": "TEST_ANTHROPIC_KEY",
            "contextWindow": 200_000,
            "maxOutputTokens": 2048,
            "thinking": thinking,
        },
        tenant_id="acme",
        secrets=policy,
        env={"TEST_ANTHROPIC_KEY": "from-env"},
    )
    try:
        assert isinstance(adapter, AnthropicMessages)
        assert (adapter.name, adapter.model, adapter.context_window) == (
            "anthropic",
            MODEL,
            200_000,
        )
        server.queue(sse_reply(text_answer("ok")))
        events = [event async for event in adapter.stream(hello(max_output_tokens=4096))]
        assert isinstance(events[-1], Completed)
    finally:
        await adapter.aclose()
    (received,) = server.received
    assert sent_key(received.headers) == "from-env"
    assert received.body["max_tokens"] == 2048
    assert received.body["thinking"] == thinking
    assert json.dumps(received.body)
