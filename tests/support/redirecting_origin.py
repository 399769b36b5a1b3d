"""An allowed provider origin that answers every request with a redirect.

It stands where a tenant's `baseUrl` points (an origin the operator allowed)
and sends each request elsewhere: a 3xx whose `Location` is the same path on
`target`, another origin. It records what it was sent, so a test can tell
that the call reached it before it was refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.support.loopback_http import LoopbackHttp

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@dataclass
class RedirectingOrigin:
    """Serves on 127.0.0.1 (a free port) until the context exits, answering
    `status` with `Location: <target><path>`."""

    target: str
    status: int = 307
    paths: list[str] = field(default_factory=list)
    port: int = 0
    _http: LoopbackHttp | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: Request) -> Response:
        self.paths.append(request.url.path)
        await request.body()
        location = f"{self.target}{request.url.path}"
        return Response(status_code=self.status, headers={"Location": location})

    async def __aenter__(self) -> RedirectingOrigin:
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=_METHODS)])
        self._http = LoopbackHttp(app)
        self.port = await self._http.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._http is not None
        await self._http.stop()
