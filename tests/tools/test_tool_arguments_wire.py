"""Tool calls on the wire, against an independent fake of the chat-completions API.

The fake below is written from the API's documented wire format (a JSON
request; an answer as `data: <chunk>` server-sent events ending with
`data: [DONE]`; errors as `{"error": {...}}` with a 4xx status), not from the
adapter's code, and it refuses what the real API refuses: tool names outside
`^[a-zA-Z0-9_-]{1,64}$`, arguments that are not a string, a tool message that
answers no call. Like a real model, it calls a tool by the name the request
offered it under (found by its description).

What it proves: a call whose arguments the model left malformed or cut off
keeps the text it sent (never `{}`), a response cut by the output limit says
"length", and the next request, built from the ledger as the runner builds
it, shows the model exactly the call it made under the name it was offered.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agent_io.providers import Completed, ModelRequest, OpenAICompatible, ToolCallDelta, ToolSpec
from compaction.transcript import request_messages
from services.ledger.facts import CommittedFact
from tests.support.loopback_http import LoopbackHttp

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
SLEEP_DESCRIPTION = "Sleep for a while."
SLEEP = ToolSpec(
    "files.sleep",
    SLEEP_DESCRIPTION,
    {"type": "object", "properties": {"seconds": {"type": "integer"}}, "required": ["seconds"]},
)
CLOCK = ToolSpec("clock", "The current time.", {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ToolTurn:
    """The fake model calls the tool described so, streaming these pieces of
    arguments, and stops for this reason."""

    description: str
    pieces: tuple[str, ...]
    finish_reason: str
    call_id: str = "call_1"


@dataclass(frozen=True)
class TextTurn:
    text: str


def _invalid(body: Any) -> str | None:
    """What the real API would refuse in this request, if anything."""
    for position, tool in enumerate(body.get("tools") or ()):
        name = tool.get("function", {}).get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            return f"Invalid 'tools[{position}].function.name': {name!r}"
    answered: set[str] = set()
    for position, message in enumerate(body.get("messages") or ()):
        for call in message.get("tool_calls") or ():
            function = call.get("function", {})
            if not NAME_PATTERN.fullmatch(str(function.get("name"))):
                return f"Invalid 'messages[{position}].tool_calls.function.name'"
            if not isinstance(function.get("arguments"), str):
                return f"Invalid 'messages[{position}].tool_calls.function.arguments'"
            answered.add(call.get("id"))
        if message.get("role") == "tool" and message.get("tool_call_id") not in answered:
            return f"messages[{position}]: a tool message must answer a preceding tool call"
    return None


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "fake-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    return f"data: {json.dumps(body)}\n\n".encode()


def _events(turn: ToolTurn | TextTurn, offered: dict[str, str]) -> Iterator[bytes]:
    yield _chunk({"role": "assistant", "content": None})
    if isinstance(turn, TextTurn):
        yield _chunk({"content": turn.text})
        yield _chunk({}, "stop")
    else:
        first = {
            "index": 0,
            "id": turn.call_id,
            "type": "function",
            "function": {"name": offered[turn.description], "arguments": ""},
        }
        yield _chunk({"tool_calls": [first]})
        for piece in turn.pieces:
            yield _chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        yield _chunk({}, turn.finish_reason)
    yield b"data: [DONE]\n\n"


@dataclass
class FakeChatCompletions:
    """POST /v1/chat/completions on loopback, answering with queued turns."""

    turns: list[ToolTurn | TextTurn]
    requests: list[Any] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.requests.append(body)
        problem = _invalid(body)
        if problem is not None:
            self.refusals.append(problem)
            error = {"message": problem, "type": "invalid_request_error", "param": None}
            return JSONResponse({"error": error}, status_code=400)
        offered = {
            tool["function"].get("description", ""): tool["function"]["name"]
            for tool in body.get("tools") or ()
        }
        turn = self.turns.pop(0)

        async def stream() -> AsyncIterator[bytes]:
            for event in _events(turn, offered):
                yield event

        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture
async def fake() -> AsyncIterator[FakeChatCompletions]:
    server = FakeChatCompletions(turns=[])
    app = Starlette(routes=[Route("/v1/chat/completions", server.handle, methods=["POST"])])
    http = LoopbackHttp(app)
    server.url = f"http://127.0.0.1:{await http.start()}/v1"
    yield server
    await http.stop()


@pytest.fixture
async def adapter(fake: FakeChatCompletions) -> AsyncIterator[OpenAICompatible]:
    provider = OpenAICompatible(model="fake-model", api_key="k", base_url=fake.url)
    yield provider
    await provider.aclose()


class Ledger:
    """Facts of one session, committed in order (what the runner would write)."""

    def __init__(self) -> None:
        self.facts: list[CommittedFact] = []

    def commit(self, kind: str, data: dict[str, Any]) -> None:
        self.facts.append(CommittedFact("s", len(self.facts) + 1, kind, data, 0, 1))

    def request(self) -> ModelRequest:
        return ModelRequest(system="", messages=request_messages(self.facts), tools=(CLOCK, SLEEP))


async def test_the_fake_refuses_what_the_api_refuses(fake: FakeChatCompletions) -> None:
    # So that its acceptance of the adapter's requests below means something.
    tool = {"type": "function", "function": {"name": "files.sleep", "parameters": {}}}
    body = {"model": "m", "messages": [], "tools": [tool], "stream": True}
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{fake.url}/chat/completions", json=body)
    assert response.status_code == 400
    assert "tools[0].function.name" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("pieces", "finish_reason", "stop_reason"),
    [
        (('{"seco', 'nds": 5'), "length", "length"),  # cut off by the output limit
        (('{"seconds": ', "five}"), "tool_calls", "toolUse"),  # malformed
        (("[5]",), "tool_calls", "toolUse"),  # JSON, but not an object
    ],
)
async def test_a_call_the_model_left_unreadable_is_kept_and_shown_back(
    fake: FakeChatCompletions,
    adapter: OpenAICompatible,
    pieces: tuple[str, ...],
    finish_reason: str,
    stop_reason: str,
) -> None:
    sent = "".join(pieces)
    fake.turns = [ToolTurn(SLEEP_DESCRIPTION, pieces, finish_reason), TextTurn("Sorry.")]
    ledger = Ledger()
    ledger.commit("input", {"text": "Sleep five seconds."})
    ledger.commit("epoch_started", {"watermark": 1})

    events = [event async for event in adapter.stream(ledger.request())]
    completed = events[-1]
    assert isinstance(completed, Completed)
    assert completed.tool_calls == (
        {"id": "call_1", "name": "files.sleep", "arguments": {}, "argumentsText": sent},
    )
    assert completed.stop_reason == stop_reason
    deltas = [event for event in events if isinstance(event, ToolCallDelta)]
    assert {event.name for event in deltas} == {"files.sleep"}
    assert "".join(event.arguments_fragment for event in deltas) == sent

    # The attempt commits the answer as it came, and refuses to run the call.
    ledger.commit(
        "assistant",
        {
            "content": list(completed.content),
            "toolCalls": [dict(call) for call in completed.tool_calls],
            "stopReason": completed.stop_reason,
        },
    )
    problem = "files.sleep was not run: its arguments are not a JSON object"
    ledger.commit("tool_result", {"toolCallId": "call_1", "content": problem, "isError": True})
    answer = [event async for event in adapter.stream(ledger.request())][-1]
    assert isinstance(answer, Completed) and answer.tool_calls == ()

    assert fake.refusals == []
    first, second = fake.requests
    offered = {tool["function"]["description"]: tool["function"]["name"] for tool in first["tools"]}
    assert offered[CLOCK.description] == "clock"
    assert NAME_PATTERN.fullmatch(offered[SLEEP_DESCRIPTION])
    # The model is shown the call it made: its own text, its offered name.
    assert second["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": offered[SLEEP_DESCRIPTION], "arguments": sent},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": problem},
    ]


async def test_a_readable_call_under_a_prefixed_name_comes_back_whole(
    fake: FakeChatCompletions, adapter: OpenAICompatible
) -> None:
    fake.turns = [ToolTurn(SLEEP_DESCRIPTION, ('{"seconds"', ": 5}"), "tool_calls")]
    ledger = Ledger()
    ledger.commit("input", {"text": "Sleep five seconds."})
    events = [event async for event in adapter.stream(ledger.request())]
    completed = events[-1]
    assert isinstance(completed, Completed)
    assert completed.tool_calls == (
        {"id": "call_1", "name": "files.sleep", "arguments": {"seconds": 5}},
    )
    assert completed.stop_reason == "toolUse"
    assert fake.refusals == []
