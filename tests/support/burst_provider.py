"""A model provider that sends a whole streamed answer in one burst.

Real providers often deliver many chunks in one TCP segment (a cached
prefix, a fast small model, a proxy that buffers): the runner then parses
and publishes every delta of the answer back to back, and commits the answer
a moment later. This server stands at a model's `baseUrl` and answers each
request with the next queued answer, all of its SSE frames written at once
(one body, one write), on the OpenAI wire (`/v1/chat/completions`) or the
Anthropic one (`/v1/messages`).

The answers are built here from the pieces a test wants the client to see
(`openai_text`, `openai_tool_call`, `anthropic_text`, `anthropic_tool_call`):
each non-empty piece is one delta the runner publishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from tests.support.loopback_http import LoopbackApp, LoopbackHttp
from tests.support.wire_servers import data_frame, event_frame

OPENAI_PATH = "/v1/chat/completions"
ANTHROPIC_PATH = "/v1/messages"
MODEL = "burst-model"


def _openai_chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    return data_frame(
        {
            "id": "chatcmpl-burst",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


def openai_text(pieces: Sequence[str]) -> list[str]:
    """A text answer, one chunk per piece."""
    return [
        _openai_chunk({"role": "assistant", "content": ""}),
        *(_openai_chunk({"content": piece}) for piece in pieces),
        _openai_chunk({}, finish="stop"),
        data_frame("[DONE]"),
    ]


def openai_tool_call(call_id: str, name: str, fragments: Sequence[str]) -> list[str]:
    """One tool call whose arguments come in `fragments` (OpenAI names the
    call in its first fragment only)."""
    first = {"index": 0, "id": call_id, "type": "function"}
    first["function"] = {"name": name, "arguments": ""}
    return [
        _openai_chunk({"role": "assistant", "content": None}),
        _openai_chunk({"tool_calls": [first]}),
        *(
            _openai_chunk({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]})
            for fragment in fragments
        ),
        _openai_chunk({}, finish="tool_calls"),
        data_frame("[DONE]"),
    ]


def _anthropic_message(blocks: list[str], stop_reason: str) -> list[str]:
    message = {
        "id": "msg_burst",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": MODEL,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1},
    }
    end = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": len(blocks)},
    }
    return [
        event_frame("message_start", {"type": "message_start", "message": message}),
        *blocks,
        event_frame("message_delta", end),
        event_frame("message_stop", {"type": "message_stop"}),
    ]


def _block(block: dict[str, Any], deltas: Sequence[dict[str, Any]]) -> list[str]:
    start = {"type": "content_block_start", "index": 0, "content_block": block}
    return [
        event_frame("content_block_start", start),
        *(
            event_frame(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
            for delta in deltas
        ),
        event_frame("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ]


def anthropic_text(pieces: Sequence[str]) -> list[str]:
    """A text answer, one content_block_delta per piece."""
    deltas = [{"type": "text_delta", "text": piece} for piece in pieces]
    return _anthropic_message(_block({"type": "text", "text": ""}, deltas), "end_turn")


def anthropic_tool_call(call_id: str, name: str, fragments: Sequence[str]) -> list[str]:
    """One tool_use block whose input comes in `fragments`."""
    deltas = [{"type": "input_json_delta", "partial_json": fragment} for fragment in fragments]
    block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
    return _anthropic_message(_block(block, deltas), "tool_use")


@dataclass
class BurstProvider(LoopbackApp):
    """Serves both wires on 127.0.0.1 (on `port`, or a free one when it is
    0) until the context exits. Each request takes the next queued answer;
    with none queued it gets a 500 (a test that forgot one fails loudly)."""

    port: int = 0
    answers: list[list[str]] = field(default_factory=list)
    requests: int = 0
    _http: LoopbackHttp | None = None

    def queue(self, *answers: list[str]) -> None:
        self.answers.extend(answers)

    async def _handle(self, request: Request) -> Response:
        await request.body()
        self.requests += 1
        if not self.answers:
            return JSONResponse({"error": {"message": "no answer queued"}}, status_code=500)
        # Every frame in one body: one write, one burst on the wire.
        burst = "".join(self.answers.pop(0)).encode()
        return Response(burst, media_type="text/event-stream")

    def app(self) -> ASGIApp:
        routes = [
            Route(OPENAI_PATH, self._handle, methods=["POST"]),
            Route(ANTHROPIC_PATH, self._handle, methods=["POST"]),
        ]
        return Starlette(routes=routes)
