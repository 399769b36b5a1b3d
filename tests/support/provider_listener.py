"""A listener standing where a tenant points its model's `baseUrl`.

It records every request it receives, whatever the method or path, with all
its headers and its raw body, so a test can check that nothing but what the
tenant was granted ever reached it. A POST to `/v1/chat/completions` is
answered as an OpenAI-compatible server would (one short streamed answer);
anything else gets a 404, and is recorded all the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from tests.support.loopback_http import LoopbackApp, LoopbackHttp
from tests.support.wire_servers import data_frame

ANSWER = "granted answer"
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    # Every header as received (names lower-cased, repeated ones kept).
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def texts(self) -> Iterable[str]:
        """Everything of this request a secret could hide in."""
        yield self.path
        for name, value in self.headers:
            yield name
            yield value
        yield self.body.decode("utf-8", "replace")


def _answer_frames() -> list[str]:
    chunk = {
        "id": "chatcmpl-listener",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "listener-model",
    }
    return [
        data_frame({**chunk, "choices": [{"index": 0, "delta": {"content": ANSWER}}]}),
        data_frame({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        data_frame("[DONE]"),
    ]


@dataclass
class ProviderListener(LoopbackApp):
    """Serves on 127.0.0.1 (a free port) until the context exits."""

    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    _http: LoopbackHttp | None = None

    async def _handle(self, request: Request) -> Response:
        self.seen.append(
            Seen(
                request.method,
                request.url.path,
                tuple(
                    (name.decode("latin-1"), value.decode("latin-1"))
                    for name, value in request.headers.raw
                ),
                await request.body(),
            )
        )
        if request.method != "POST" or request.url.path != "/v1/chat/completions":
            return JSONResponse({"error": {"message": "not here"}}, status_code=404)

        async def frames() -> AsyncIterator[bytes]:
            for frame in _answer_frames():
                yield frame.encode()

        return StreamingResponse(frames(), media_type="text/event-stream")

    def app(self) -> ASGIApp:
        return Starlette(routes=[Route("/{path:path}", self._handle, methods=_METHODS)])
