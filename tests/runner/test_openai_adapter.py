"""The OpenAI-compatible adapter against a real local chat-completions server."""

from __future__ import annotations

import base64
import email.utils
import json
import re
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent_io.providers import (
    Completed,
    ContextOverflow,
    ModelRequest,
    OpenAICompatible,
    ProviderError,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
    provider_from_loadout,
)
from agent_io.providers.base import retry_after_ms
from compaction.transcript import request_messages
from services.common.secrets import SecretPolicy
from services.ledger.facts import CommittedFact
from tests.support.blobs import PNG, attached
from tests.support.fault_provider import Fault, openai_error
from tests.support.provider_checks import collect, fault_read, hello, refused
from tests.support.provider_frames import DONE, chunk, tool_delta, usage_chunk
from tests.support.wire_servers import WireServer, data_frame, sse_reply

MODEL = "gpt-test"
CLOCK = ToolSpec("clock", "Current time.", {"type": "object", "properties": {}})
SLEEP = ToolSpec("sleep", "Wait.", {"type": "object", "properties": {"seconds": {}}})


@pytest.fixture
async def server() -> AsyncIterator[WireServer]:
    async with WireServer("/v1/chat/completions") as wire:
        yield wire


@pytest.fixture
async def provider(server: WireServer) -> AsyncIterator[OpenAICompatible]:
    adapter = OpenAICompatible(model=MODEL, api_key="test-key", base_url=f"{server.url}/v1")
    yield adapter
    await adapter.aclose()


async def test_streams_text_with_usage(server: WireServer, provider: OpenAICompatible) -> None:
    server.queue(
        sse_reply(
            [
                chunk({"role": "assistant", "content": ""}),
                chunk({"reasoning_content": "Greet back."}),
                chunk({"content": "Hel"}),
                chunk({"content": "lo!"}),
                chunk(finish="stop"),
                usage_chunk(120, 7, cached=100),
                DONE,
            ]
        )
    )
    events, completed = await collect(provider, hello(max_output_tokens=256))

    assert events == [ThinkingDelta("Greet back."), TextDelta("Hel"), TextDelta("lo!")]
    assert completed.content == (
        {"type": "thinking", "thinking": "Greet back."},
        {"type": "text", "text": "Hello!"},
    )
    assert completed.tool_calls == ()
    assert completed.stop_reason == "stop"
    assert completed.usage == Usage(input=20, output=7, cache_read=100)
    assert completed.model == "gpt-test-2024"
    assert completed.extra == {"responseId": "chatcmpl-1"}

    (received,) = server.received
    assert received.headers["authorization"] == "Bearer test-key"
    assert received.body == {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ],
        "max_completion_tokens": 256,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_tool_calls_arrive_in_fragments(
    server: WireServer, provider: OpenAICompatible
) -> None:
    server.queue(
        sse_reply(
            [
                chunk({"role": "assistant", "content": None}),
                chunk(tool_delta(0, "", "call_a", "clock")),
                chunk(tool_delta(0, '{"tz":')),
                chunk(tool_delta(1, '{"ke', "call_b", "counter")),
                chunk(tool_delta(0, ' "UTC"}')),
                chunk(tool_delta(1, 'y": "k"}')),
                chunk(finish="tool_calls"),
                usage_chunk(50, 30),
                DONE,
            ]
        )
    )
    events, completed = await collect(provider, hello(tools=(CLOCK,)))

    assert all(isinstance(event, ToolCallDelta) for event in events)
    fragments: dict[int, str] = {}
    for event in events:
        assert isinstance(event, ToolCallDelta)
        assert (event.id, event.name) == (("call_a", "clock"), ("call_b", "counter"))[event.index]
        fragments[event.index] = fragments.get(event.index, "") + event.arguments_fragment
    assert fragments == {0: '{"tz": "UTC"}', 1: '{"key": "k"}'}
    assert completed.tool_calls == (
        {"id": "call_a", "name": "clock", "arguments": {"tz": "UTC"}},
        {"id": "call_b", "name": "counter", "arguments": {"key": "k"}},
    )
    assert completed.stop_reason == "toolUse"
    assert completed.content == ()
    assert server.received[0].body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "clock",
                "description": "Current time.",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]


async def test_transcript_is_converted(server: WireServer, provider: OpenAICompatible) -> None:
    server.queue(sse_reply([chunk({"content": "ok"}), chunk(finish="length"), DONE]))
    image = {"type": "image", "data": "AAAA", "mimeType": "image/png"}
    messages = (
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, image]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hidden"},
                {"type": "text", "text": "Checking."},
                {"type": "toolCall", "id": "c1", "name": "clock", "arguments": {}},
                {"type": "toolCall", "id": "c2", "name": "shot", "arguments": {"w": 2}},
            ],
        },
        {"role": "toolResult", "toolCallId": "c1", "toolName": "clock", "content": "12:00"},
        {
            "role": "toolResult",
            "toolCallId": "c2",
            "toolName": "shot",
            "content": [image],
            "isError": False,
        },
        {"role": "user", "content": "And now?"},
    )
    _, completed = await collect(provider, ModelRequest(system="", messages=messages))
    assert completed.stop_reason == "length"

    data_url = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert server.received[0].body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, data_url]},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "shot", "arguments": '{"w": 2}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c2", "content": "(see the images below)"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Images returned by shot:"}, data_url],
        },
        {"role": "user", "content": "And now?"},
    ]


async def test_an_inputs_blobs_become_wire_parts_in_order(
    server: WireServer, provider: OpenAICompatible, tmp_path: Path
) -> None:
    server.queue(sse_reply([chunk({"content": "ok"}), chunk(finish="stop"), DONE]))
    notes = b"name,qty\noat milk,2\n"
    message = attached(tmp_path, "compare", (PNG, "image/png"), (notes, "text/csv"))
    await collect(provider, ModelRequest(system="", messages=(message,)))

    (user_message,) = server.received[0].body["messages"]
    png_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    file_text = message["content"][2]["text"]
    assert file_text.endswith(":\n" + notes.decode())
    assert user_message == {
        "role": "user",
        "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": png_url}},
            {"type": "text", "text": file_text},
        ],
    }


@pytest.mark.parametrize(
    ("status", "body", "kind", "retryable"),
    [
        (
            429,
            {"error": {"message": "Rate limit reached", "type": "requests"}},
            ProviderError,
            True,
        ),
        (500, {"error": {"message": "The server had an error"}}, ProviderError, True),
        (503, {"error": {"message": "Overloaded"}}, ProviderError, True),
        (401, {"error": {"message": "Incorrect API key", "code": "invalid_api_key"}}, None, False),
        (
            400,
            {"error": {"message": "Too big.", "code": "context_length_exceeded"}},
            ContextOverflow,
            False,
        ),
        (
            400,
            {"error": {"message": "This model's maximum context length is 8192 tokens."}},
            ContextOverflow,
            False,
        ),
    ],
)
async def test_http_errors_are_classified(
    server: WireServer,
    provider: OpenAICompatible,
    status: int,
    body: dict[str, Any],
    kind: type[ProviderError] | None,
    retryable: bool,
) -> None:
    error = await refused(server, provider, status, body)
    assert isinstance(error, ContextOverflow) is (kind is ContextOverflow)
    assert error.retryable is retryable


@pytest.mark.parametrize(
    ("fault", "retryable", "rate_limited", "wait_ms"),
    [
        (
            openai_error(429, "Slow down.", "rate_limit_exceeded", retry_after="30"),
            True,
            True,
            30_000,
        ),
        (
            openai_error(529, "Overloaded.", retry_after_ms="1500", retry_after="9"),
            True,
            True,
            1500,
        ),
        (openai_error(429, "Slow down."), True, True, None),
        (openai_error(503, "Unavailable.", retry_after="2"), True, False, 2000),
        # A 429 that no wait fixes: the account is out of credit.
        (openai_error(429, "Quota exceeded.", "insufficient_quota"), False, False, None),
        (openai_error(401, "Incorrect API key.", "invalid_api_key"), False, False, None),
    ],
)
async def test_rate_limits_and_retry_after_are_read(
    fault: Fault, retryable: bool, rate_limited: bool, wait_ms: int | None
) -> None:
    def adapter(url: str) -> OpenAICompatible:
        return OpenAICompatible(model=MODEL, api_key="k", base_url=f"{url}/v1")

    read = await fault_read("/v1/chat/completions", adapter, fault)
    assert read == (retryable, rate_limited, wait_ms)


def test_retry_after_forms() -> None:
    now = 1_700_000_000.0
    in_a_minute = email.utils.formatdate(now + 60, usegmt=True)
    assert retry_after_ms({"retry-after": in_a_minute}, now) == 60_000
    assert retry_after_ms({"retry-after": email.utils.formatdate(now - 60, usegmt=True)}, now) == 0
    assert retry_after_ms({"retry-after": "0.25"}) == 250
    assert retry_after_ms({"retry-after-ms": "12.5", "retry-after": "3"}) == 13
    for unusable in ("soon", "-1", "nan", "inf", ""):
        assert retry_after_ms({"retry-after": unusable}) is None, unusable
    assert retry_after_ms({"retry-after": str(10**12)}) == 86_400_000
    assert retry_after_ms({}) is None and retry_after_ms(None) is None


async def test_error_event_inside_the_stream_is_retryable(
    server: WireServer, provider: OpenAICompatible
) -> None:
    server.queue(
        sse_reply(
            [chunk({"content": "par"}), data_frame({"error": {"message": "upstream hiccup"}})]
        )
    )
    with pytest.raises(ProviderError) as caught:
        await collect(provider, hello())
    assert caught.value.retryable
    assert "upstream hiccup" in str(caught.value)


async def test_a_cut_stream_is_not_an_answer(
    server: WireServer, provider: OpenAICompatible
) -> None:
    server.queue(sse_reply([chunk({"content": "half an ans"})]))
    with pytest.raises(ProviderError) as caught:
        await collect(provider, hello())
    assert caught.value.retryable
    assert not isinstance(caught.value, ContextOverflow)


async def test_cut_off_arguments_are_kept_as_the_model_sent_them(
    server: WireServer, provider: OpenAICompatible
) -> None:
    # The output limit cuts the call mid-arguments: the text must not become
    # {} (the tool would run with its defaults), and the stop says why.
    server.queue(
        sse_reply(
            [
                chunk(tool_delta(0, '{"seco', "call_x", "sleep")),
                chunk(tool_delta(0, 'nds": 5')),
                chunk(finish="length"),
                DONE,
            ]
        )
    )
    events, completed = await collect(provider, hello(tools=(SLEEP,)))
    assert "".join(e.arguments_fragment for e in events if isinstance(e, ToolCallDelta)) == (
        '{"seconds": 5'
    )
    assert completed.tool_calls == (
        {"id": "call_x", "name": "sleep", "arguments": {}, "argumentsText": '{"seconds": 5'},
    )
    assert completed.stop_reason == "length"
    assert "invalidToolArguments" not in completed.extra


@pytest.mark.parametrize("sent", ["[5]", '"5"', "5", "null", '{"a": 1} {"b": 2}', '{"a": NaN}'])
async def test_arguments_that_are_not_an_object_are_kept(
    server: WireServer, provider: OpenAICompatible, sent: str
) -> None:
    server.queue(
        sse_reply([chunk(tool_delta(0, sent, "call_y", "sleep")), chunk(finish="tool_calls"), DONE])
    )
    _, completed = await collect(provider, hello(tools=(SLEEP,)))
    assert completed.tool_calls == (
        {"id": "call_y", "name": "sleep", "arguments": {}, "argumentsText": sent},
    )
    assert completed.stop_reason == "toolUse"


async def test_no_arguments_at_all_are_an_empty_object(
    server: WireServer, provider: OpenAICompatible
) -> None:
    server.queue(
        sse_reply([chunk(tool_delta(0, "", "call_z", "clock")), chunk(finish="tool_calls"), DONE])
    )
    _, completed = await collect(provider, hello(tools=(CLOCK,)))
    assert completed.tool_calls == ({"id": "call_z", "name": "clock", "arguments": {}},)


async def test_prefixed_tool_names_travel_as_wire_names_and_come_back(
    server: WireServer, provider: OpenAICompatible
) -> None:
    read = ToolSpec("files.read", "Read a file.", {"type": "object"})
    fetch = ToolSpec("web/fetch.v2", "Fetch a page.", {"type": "object"})
    history = (
        {"role": "user", "content": "Read a."},
        {
            "role": "assistant",
            "content": [
                {"type": "toolCall", "id": "c0", "name": "files.read", "arguments": {"p": "a"}}
            ],
        },
        {"role": "toolResult", "toolCallId": "c0", "toolName": "files.read", "content": "A"},
        {"role": "user", "content": "Now b, and fetch."},
    )
    server.queue(
        sse_reply(
            [
                chunk(tool_delta(0, '{"p": ', "c1", "files_read")),
                chunk(tool_delta(1, "{}", "c2", "web_fetch_v2")),
                chunk(tool_delta(0, '"b"}')),
                chunk(finish="tool_calls"),
                DONE,
            ]
        )
    )
    request = ModelRequest(system="", messages=history, tools=(read, CLOCK, fetch))
    events, completed = await collect(provider, request)

    body = server.received[0].body
    assert [tool["function"]["name"] for tool in body["tools"]] == [
        "files_read",
        "clock",
        "web_fetch_v2",
    ]
    (earlier,) = body["messages"][1]["tool_calls"]
    assert earlier["function"] == {"name": "files_read", "arguments": '{"p": "a"}'}
    assert {(e.index, e.name) for e in events if isinstance(e, ToolCallDelta)} == {
        (0, "files.read"),
        (1, "web/fetch.v2"),
    }
    assert completed.tool_calls == (
        {"id": "c1", "name": "files.read", "arguments": {"p": "b"}},
        {"id": "c2", "name": "web/fetch.v2", "arguments": {}},
    )


async def test_awkward_names_get_distinct_wire_safe_names(
    server: WireServer, provider: OpenAICompatible
) -> None:
    names = [
        "a.b",
        "a/b",  # reads the same as a.b once made wire-safe
        "a_b.c",
        "a_b_c",  # already safe: kept, so a_b.c must not take it
        "files." + "x" * 80,  # too long
        "files." + "x" * 80 + ".y",
        "outils.résumé",
        "",
    ]
    tools = tuple(ToolSpec(name, "t", {"type": "object"}) for name in names)
    server.queue(
        sse_reply([chunk({"content": "ok"}), chunk(finish="stop"), DONE]),
        sse_reply([chunk({"content": "ok"}), chunk(finish="stop"), DONE]),
    )
    await collect(provider, hello(tools=tools))
    await collect(provider, hello(tools=tuple(reversed(tools))))

    first, second = (
        [tool["function"]["name"] for tool in received.body["tools"]]
        for received in server.received
    )
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name) for name in first)
    assert len(set(first)) == len(names)
    assert first[3] == "a_b_c"
    assert second == list(reversed(first))  # a function of the names, not their order


async def test_a_presented_call_with_raw_arguments_is_sent_verbatim(
    server: WireServer, provider: OpenAICompatible
) -> None:
    # The ledger's assistant fact keeps what the model sent; the next request
    # must show it that, not an empty object.
    raw = '{"seconds": 5'
    facts = [
        CommittedFact("s", 1, "input", {"text": "Sleep."}, 0, 1),
        CommittedFact("s", 2, "epoch_started", {"watermark": 1}, 0, 1),
        CommittedFact(
            "s",
            3,
            "assistant",
            {
                "content": [],
                "toolCalls": [
                    {"id": "c1", "name": "files.sleep", "arguments": {}, "argumentsText": raw}
                ],
                "stopReason": "length",
            },
            0,
            1,
        ),
        CommittedFact(
            "s",
            4,
            "tool_result",
            {"toolCallId": "c1", "content": "not run: arguments cut off", "isError": True},
            0,
            1,
        ),
    ]
    messages = request_messages(facts)
    server.queue(sse_reply([chunk({"content": "ok"}), chunk(finish="stop"), DONE]))
    await collect(provider, ModelRequest(system="", messages=messages))

    sent = server.received[0].body["messages"]
    assert sent[1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "files_sleep", "arguments": raw}}
    ]
    assert sent[2]["content"] == "not run: arguments cut off"


async def test_consumer_can_stop_mid_stream(server: WireServer, provider: OpenAICompatible) -> None:
    frames = [chunk({"content": f"t{i} "}) for i in range(50)]
    server.queue(sse_reply([*frames, chunk(finish="stop"), DONE], frame_delay=0.01))
    stream = provider.stream(hello())
    assert isinstance(stream, AsyncGenerator)
    first = await anext(stream)
    assert first == TextDelta("t0 ")
    await stream.aclose()  # releases the HTTP response (filterwarnings=error checks leaks)


async def test_unreachable_server_is_retryable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    adapter = OpenAICompatible(model=MODEL, api_key="k", base_url=f"http://127.0.0.1:{port}/v1")
    try:
        with pytest.raises(ProviderError) as caught:
            await collect(adapter, hello())
        assert caught.value.retryable
    finally:
        await adapter.aclose()


async def test_loadout_builds_the_adapter(server: WireServer) -> None:
    # The operator allows the test's server and grants the variable to the
    # tenant; the runner refuses both otherwise.
    policy = SecretPolicy().with_grant("acme", "TEST_OPENAI_KEY").with_origin(server.url)
    adapter = provider_from_loadout(
        {
            "provider": "openai",
            "name": MODEL,
            "baseUrl": f"{server.url}/v1",
            "apiKeyEnv": "TEST_OPENAI_KEY",
            "contextWindow": 8192,
            "maxOutputTokens": 100,
        },
        tenant_id="acme",
        secrets=policy,
        env={"TEST_OPENAI_KEY": "from-env"},
    )
    try:
        assert isinstance(adapter, OpenAICompatible)
        assert (adapter.name, adapter.model, adapter.context_window) == ("openai", MODEL, 8192)
        server.queue(sse_reply([chunk({"content": "ok"}), chunk(finish="stop"), DONE]))
        events = [event async for event in adapter.stream(hello(max_output_tokens=4096))]
        assert isinstance(events[-1], Completed)
    finally:
        await adapter.aclose()
    (received,) = server.received
    assert received.headers["authorization"] == "Bearer from-env"
    assert received.body["max_completion_tokens"] == 100
    assert json.dumps(received.body["messages"])  # plain JSON all the way
