"""A model provider that fails as a test tells it to, over real HTTP.

It stands at a model's `baseUrl` and answers each request on `path` with the
next queued `Fault` (a status, a JSON error body and headers such as
`retry-after`); once the queue is empty it answers with `then`, a fault
repeated forever, or, when `then` is None, one short streamed
chat-completions answer (`ANSWER`). Every request is counted, so a test can
tell how often the provider was asked.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from tests.support.loopback_http import LoopbackApp, LoopbackHttp

ANSWER = "answered after the faults"


@dataclass(frozen=True)
class Fault:
    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


def openai_error(status: int, message: str, code: str = "", **headers: str) -> Fault:
    """An error as OpenAI sends it; header names with `_` are sent with `-`."""
    error: dict[str, Any] = {"message": message, "type": "error"}
    if code:
        error["code"] = code
    return Fault(status, {"error": error}, _headers(headers))


def anthropic_error(status: int, kind: str, message: str, **headers: str) -> Fault:
    """An error as Anthropic sends it; header names with `_` are sent with `-`."""
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return Fault(status, body, _headers(headers))


def _headers(given: Mapping[str, str]) -> dict[str, str]:
    return {name.replace("_", "-"): value for name, value in given.items()}


def _answer_frames() -> list[bytes]:
    head = {"id": "chatcmpl-faults", "object": "chat.completion.chunk", "created": 1}
    head["model"] = "fault-model"
    deltas = [
        {"index": 0, "delta": {"content": ANSWER}},
        {"index": 0, "delta": {}, "finish_reason": "stop"},
    ]
    frames = [f"data: {json.dumps({**head, 'choices': [delta]})}\n\n" for delta in deltas]
    return [frame.encode() for frame in [*frames, "data: [DONE]\n\n"]]


@dataclass
class FaultyProvider(LoopbackApp):
    """Serves `path` on 127.0.0.1 (on `port`, or a free one when it is 0)
    until the context exits."""

    path: str = "/v1/chat/completions"
    port: int = 0
    faults: list[Fault] = field(default_factory=list)
    then: Fault | None = None
    requests: int = 0
    _http: LoopbackHttp | None = None

    def queue(self, *faults: Fault) -> None:
        self.faults.extend(faults)

    async def _handle(self, request: Request) -> Response:
        await request.body()
        self.requests += 1
        fault = self.faults.pop(0) if self.faults else self.then
        if fault is not None:
            return JSONResponse(fault.body, status_code=fault.status, headers=dict(fault.headers))

        async def frames() -> AsyncIterator[bytes]:
            for frame in _answer_frames():
                yield frame

        return StreamingResponse(frames(), media_type="text/event-stream")

    def app(self) -> ASGIApp:
        return Starlette(routes=[Route(self.path, self._handle, methods=["POST"])])
