"""A real HTTP server on 127.0.0.1 for a test's own Starlette app (a fake
model provider, a listener at a tenant's `baseUrl`): started, then its port
known, then stopped, the same way for every such server."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self

import uvicorn
from starlette.types import ASGIApp

START_DEADLINE_S = 5.0


class LoopbackHttp:
    """Serves `app` on 127.0.0.1: on `port`, or a free one when it is 0."""

    def __init__(self, app: ASGIApp, port: int = 0) -> None:
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http="h11",
            ws="none",
        )
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None
        self.port = port

    async def start(self) -> int:
        """Serves until `stop`; returns the bound port."""
        self._task = asyncio.create_task(self._server.serve())
        async with asyncio.timeout(START_DEADLINE_S):
            while not self._server.started:
                if self._task.done():
                    await self._task  # surfaces the startup error
                    raise RuntimeError("the test's HTTP server exited during startup")
                await asyncio.sleep(0.005)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        assert self._task is not None
        self._server.should_exit = True
        await self._task


class LoopbackApp:
    """A test server of its own app (a fake provider, a listener): `async
    with` serves `app()` on 127.0.0.1 at `self.port` (a free one when it is
    0, then the bound one) and stops it on exit."""

    port: int = 0
    _http: LoopbackHttp | None = None

    @property
    def url(self) -> str:
        """Where it serves (the bound port once started)."""
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> ASGIApp:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self._http = LoopbackHttp(self.app(), self.port)
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
