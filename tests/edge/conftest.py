"""A real edge over real HTTP, on PostgreSQL, for the edge's end-to-end tests.

`stack` is an in-process ledger and kernel (tests/runner/cluster.py), a
compaction server (the edge's /context), an EdgeServer on 127.0.0.1:0 (its
gRPC API on another free port) and an httpx client carrying the key of
tenant "default" that `keel up` prints: its admin and an operator. A runner
is added only where a test asks for one: in process (`runner` fixture) or as
an OS process (`stack.cluster.start_runner`) when the test SIGKILLs it.
Nothing of ours is mocked; waits poll with a deadline or wait for SSE
frames, never sleep.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from compaction.server import CompactionServer
from edge.gateway import EdgeConfig, Gateway
from edge.server import EdgeServer
from services.cli.chat_view import SseEvent, SseParser
from services.common.config import Settings
from services.ledger import CommittedFact
from services.ledger.client import FactToAppend
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer
from tests.runner.cluster import Cluster, start_cluster, stop_cluster

ADMIN_KEY = "edge-test-admin-key-0123456789"
DEADLINE_S = 30.0


@dataclass
class Stack:
    cluster: Cluster
    edge: EdgeServer
    http: httpx.AsyncClient
    compaction: CompactionServer
    runners: list[RunnerServer] = field(default_factory=list)

    @property
    def gateway(self) -> Gateway:
        assert self.edge.gateway is not None
        return self.edge.gateway

    @property
    def url(self) -> str:
        return self.edge.url

    @property
    def grpc_address(self) -> str:
        """host:port of the edge's public gRPC API (keel.sessions.v1)."""
        assert self.edge.grpc_address is not None
        return self.edge.grpc_address

    async def new_session(self, session_id: str | None = None) -> str:
        body = {"id": session_id} if session_id else {}
        response = await self.http.post("/v1/sessions", json=body)
        assert response.status_code == 201, response.text
        sid: str = response.json()["id"]
        return sid

    async def post_input(self, session_id: str, text: str, request_id: str) -> httpx.Response:
        return await self.http.post(
            f"/v1/sessions/{session_id}/inputs", json={"text": text, "requestId": request_id}
        )

    def client(self, key: str) -> httpx.AsyncClient:
        """An HTTP client of this edge sending `key` (the caller closes it)."""
        return httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(DEADLINE_S),
        )

    @staticmethod
    def ledger_id(session_id: str, tenant: str = "default") -> str:
        """The ledger's id of a session the edge calls `session_id`."""
        return f"{tenant}:{session_id}"

    async def facts(self, session_id: str) -> list[CommittedFact]:
        return await self.cluster.facts(self.ledger_id(session_id))

    async def append_inputs(self, session_id: str, count: int, prefix: str = "bulk") -> int:
        """Commits `count` input facts straight to the ledger; returns the head."""
        head = 0
        for start in range(0, count, 250):
            batch = [
                FactToAppend("input", {"text": f"{prefix} {i}", "requestId": f"{prefix}-{i}"})
                for i in range(start, min(start + 250, count))
            ]
            appended = await self.cluster.ledger.append(self.ledger_id(session_id), batch)
            head = appended[-1].seq
        return head

    async def start_runner(self) -> RunnerServer:
        cluster = self.cluster
        runner = await RunnerServer(
            cluster.settings,
            RunnerConfig(cluster.ledger_server.target, cluster.kernel_server.target),
        ).start()
        self.runners.append(runner)
        return runner


@pytest.fixture
async def stack(pg_settings: Settings) -> AsyncIterator[Stack]:
    cluster = await start_cluster(pg_settings, backoff_base_ms=100, max_attempts=3)
    compaction: CompactionServer | None = None
    edge: EdgeServer | None = None
    http: httpx.AsyncClient | None = None
    running: Stack | None = None
    try:
        await cluster.kernel.create_api_key("default", ADMIN_KEY, admin=True, operator=True)
        compaction = await CompactionServer(
            pg_settings, cluster.ledger_server.target, cluster.kernel_server.target
        ).start()
        edge = await EdgeServer(
            pg_settings,
            EdgeConfig(
                cluster.ledger_server.target,
                cluster.kernel_server.target,
                compaction.target,
                drain_retry_after_ms=250,
                grpc_port=0,
            ),
        ).start()
        http = httpx.AsyncClient(
            base_url=edge.url,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=httpx.Timeout(DEADLINE_S),
        )
        running = Stack(cluster, edge, http, compaction)
        yield running
    finally:
        if http is not None:
            await http.aclose()
        if edge is not None:
            await edge.stop()
        if running is not None:
            for runner in running.runners:
                await runner.stop(grace=0.2)
        if compaction is not None:
            await compaction.stop(grace=0.2)
        await stop_cluster(cluster)


@pytest.fixture
async def runner(stack: Stack) -> RunnerServer:
    """An in-process runner working for `stack` (stopped with it)."""
    return await stack.start_runner()


# ------------------------------------------------------------------ SSE


def parse(event: SseEvent) -> Any:
    return json.loads(event.data)


class SseReader:
    """One open event stream: yields parsed events; `close()` cuts it."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        session_id: str,
        last_event_id: str | None = None,
        after: int | None = None,
        key: str | None = None,
    ) -> None:
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        params = {"after": str(after)} if after is not None else {}
        self._context = http.stream(
            "GET", f"/v1/sessions/{session_id}/events", headers=headers, params=params
        )
        self.response: httpx.Response | None = None
        self._lines: AsyncIterator[str] | None = None
        self._parser = SseParser()

    async def __aenter__(self) -> SseReader:
        self.response = await self._context.__aenter__()
        assert self.response.status_code == 200, (await self.response.aread()).decode()
        assert self.response.headers["content-type"].startswith("text/event-stream")
        self._lines = self.response.aiter_lines()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._context.__aexit__(None, None, None)

    async def next(self, deadline_s: float = DEADLINE_S) -> SseEvent | None:
        """The next event, or None when the server ended the stream."""
        assert self._lines is not None

        async def one() -> SseEvent | None:
            assert self._lines is not None
            async for line in self._lines:
                event = self._parser.feed(line)
                if event is not None:
                    return event
            return None

        return await asyncio.wait_for(one(), deadline_s)

    async def until(
        self, predicate: Any, deadline_s: float = DEADLINE_S, into: list[SseEvent] | None = None
    ) -> SseEvent:
        """Reads until an event matches `predicate` (every event read goes to `into`)."""
        deadline = time.monotonic() + deadline_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError("no matching SSE event before the deadline")
            try:
                event = await self.next(remaining)
            except TimeoutError:
                raise AssertionError("no matching SSE event before the deadline") from None
            if event is None:
                raise AssertionError("the server ended the stream before a matching event")
            if into is not None:
                into.append(event)
            if predicate(event):
                return event


def fact_seqs(events: list[SseEvent]) -> list[int]:
    return [int(e.id) for e in events if e.id is not None]
