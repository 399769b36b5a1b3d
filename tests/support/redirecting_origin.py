"""An allowed provider origin that answers every request with a redirect.

It stands where a tenant's `baseUrl` points (an origin the operator allowed)
and sends each request elsewhere: a 3xx whose `Location` is the same path on
`target`, another origin. It records what it was sent, so a test can tell
that the call reached it before it was refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from tests.support.loopback_http import LoopbackApp, LoopbackHttp

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@dataclass
class RedirectingOrigin(LoopbackApp):
    """Serves on 127.0.0.1 (a free port) until the context exits, answering
    `status` with `Location: <target><path>`."""

    target: str
    status: int = 307
    paths: list[str] = field(default_factory=list)
    port: int = 0
    _http: LoopbackHttp | None = None

    async def _handle(self, request: Request) -> Response:
        self.paths.append(request.url.path)
        await request.body()
        location = f"{self.target}{request.url.path}"
        return Response(status_code=self.status, headers={"Location": location})

    def app(self) -> ASGIApp:
        return Starlette(routes=[Route("/{path:path}", self._handle, methods=_METHODS)])
