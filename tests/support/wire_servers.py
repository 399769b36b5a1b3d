"""A real local HTTP server that plays a model provider's wire protocol.

Tests queue the replies it gives (an SSE stream or a JSON error, in order)
and read back the requests it received, so the adapters are exercised through
their SDKs over real HTTP, with no mocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from tests.support.loopback_http import LoopbackApp, LoopbackHttp


@dataclass(frozen=True)
class Reply:
    """One scripted answer: SSE frames (status 200) or a JSON error body."""

    frames: Sequence[str] = ()
    status: int = 200
    body: Any = None
    # Seconds to wait before each frame (lets a test cancel mid-stream).
    frame_delay: float = 0.0


def sse_reply(frames: Sequence[str], frame_delay: float = 0.0) -> Reply:
    return Reply(frames=tuple(frames), frame_delay=frame_delay)


def error_reply(status: int, body: Any) -> Reply:
    return Reply(status=status, body=body)


def data_frame(payload: Any) -> str:
    """An unnamed SSE event (OpenAI's style)."""
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {text}\n\n"


def event_frame(name: str, payload: Any) -> str:
    """A named SSE event (Anthropic's style)."""
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class WireServer(LoopbackApp):
    """Serves `path` on 127.0.0.1 until the context exits: on `port`, or a
    free port when it is 0 (a port fixed up front lets a test allow the
    server's origin before the server runs)."""

    path: str
    replies: list[Reply] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    port: int = 0
    _http: LoopbackHttp | None = None

    def queue(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    async def _handle(self, request: Request) -> Response:
        self.received.append(
            Received(request.url.path, dict(request.headers), json.loads(await request.body()))
        )
        if not self.replies:
            return JSONResponse({"error": {"message": "no reply queued"}}, status_code=418)
        reply = self.replies.pop(0)
        if not reply.frames:
            return JSONResponse(reply.body, status_code=reply.status)

        async def frames() -> AsyncIterator[bytes]:
            for frame in reply.frames:
                if reply.frame_delay:
                    await asyncio.sleep(reply.frame_delay)
                yield frame.encode()

        return StreamingResponse(frames(), media_type="text/event-stream")

    def app(self) -> ASGIApp:
        return Starlette(routes=[Route(self.path, self._handle, methods=["POST"])])
