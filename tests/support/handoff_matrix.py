"""Two edges, real runner processes and one SSE client, for the handoff matrix.

`handoff_stack` runs a ledger and a kernel in the test's process (as
tests/support/cluster.py does) and two in-process edges over real HTTP, so a
client can be moved off an edge that drains. `SseFollower` is that client:
it reads a session's event stream from before its first input, keeps every
fact it is sent, and reconnects with `Last-Event-ID` whenever a stream ends
(to the next edge when its edge drains), as a browser would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from services.cli.chat_view import SseParser
from services.common.config import Settings
from services.ledger import CommittedFact
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.polling import eventually
from tests.support.processes import ChildProcess

OPERATOR_KEY = "handoff-matrix-operator-key-0123456789"
DEADLINE_S = 60.0
# A client that reconnects this often has met an edge that keeps ending its
# streams: a bug, not a handoff.
MAX_RECONNECTS = 20


@dataclass
class HandoffStack:
    cluster: Cluster
    edges: list[EdgeServer]
    http: httpx.AsyncClient

    @staticmethod
    def ledger_id(session_id: str) -> str:
        """The ledger's (and kernel's) id of a session of tenant `default`."""
        return f"default:{session_id}"

    async def new_session(self, session_id: str) -> None:
        response = await self.http.post("/v1/sessions", json={"id": session_id})
        assert response.status_code == 201, response.text

    async def post_input(self, session_id: str, text: str, request_id: str) -> int:
        response = await self.http.post(
            f"/v1/sessions/{session_id}/inputs", json={"text": text, "requestId": request_id}
        )
        assert response.status_code == 202, response.text
        seq: int = response.json()["seq"]
        return seq

    async def facts(self, session_id: str) -> list[CommittedFact]:
        return await self.cluster.facts(self.ledger_id(session_id))

    async def drain_visible(self, runtime_id: str) -> None:
        """Waits until the kernel knows `runtime_id` drains: from then on it
        hands that runtime no lease, so work queued later goes elsewhere."""

        async def probe() -> bool | None:
            runtimes = await self.cluster.kernel.list_runtimes()
            drains = any(r.runtime_id == runtime_id and r.drain_mode != "none" for r in runtimes)
            return True if drains else None

        await eventually(probe, f"{runtime_id} draining", DEADLINE_S)


@contextlib.asynccontextmanager
async def handoff_stack(settings: Settings, edges: int = 2) -> AsyncIterator[HandoffStack]:
    cluster = await start_cluster(settings, backoff_base_ms=100, max_attempts=3)
    servers: list[EdgeServer] = []
    http: httpx.AsyncClient | None = None
    try:
        await cluster.kernel.create_api_key("default", OPERATOR_KEY, admin=True, operator=True)
        config = EdgeConfig(
            cluster.ledger_server.target, cluster.kernel_server.target, drain_retry_after_ms=250
        )
        for _ in range(edges):
            servers.append(await EdgeServer(settings, config).start())
        http = edge_client(servers[0])
        yield HandoffStack(cluster, servers, http)
    finally:
        if http is not None:
            await http.aclose()
        for server in servers:
            await server.stop()
        await stop_cluster(cluster)


def edge_client(edge: EdgeServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=edge.url,
        headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
        timeout=httpx.Timeout(DEADLINE_S),
    )


def runtime_id_of(runner: ChildProcess) -> str:
    """The runtime id a runner process printed when it started serving."""
    line = runner.wait_for_line(
        lambda text: text.startswith("runner ") and " listening on " in text
    )
    return line.split()[1]


@dataclass
class SseFollower:
    """One client of a session's event stream, across reconnects and edges."""

    edges: list[EdgeServer]
    session_id: str
    facts: list[CommittedFact] = field(default_factory=list)
    # Every `id:` the client was sent, in order (repeats and gaps included:
    # that is what the checks look at).
    seqs: list[int] = field(default_factory=list)
    # The epoch of every delta, and of every fact, in the order received
    # (`delta` or the fact's kind first).
    timeline: list[tuple[str, int]] = field(default_factory=list)
    drains: int = 0
    reconnects: int = 0
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    _edge: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        """Follows the stream until cancelled."""
        while True:
            drained = await self._one_stream()
            if drained:
                self.drains += 1
                # The edge drains: go on at another one (a load balancer
                # would route the reconnect away from a draining pod).
                self._edge = min(self._edge + 1, len(self.edges) - 1)
            self.reconnects += 1
            assert self.reconnects <= MAX_RECONNECTS, f"{self.reconnects} reconnects"

    async def _one_stream(self) -> bool:
        """Reads one connection to its end; True when it ended with `drain`."""
        headers = {"Accept": "text/event-stream"}
        if self.seqs:
            headers["Last-Event-ID"] = str(self.seqs[-1])
        parser = SseParser()
        async with (
            edge_client(self.edges[self._edge]) as http,
            http.stream("GET", f"/v1/sessions/{self.session_id}/events", headers=headers) as r,
        ):
            assert r.status_code == 200, (await r.aread()).decode()
            self.connected.set()
            async for line in r.aiter_lines():
                event = parser.feed(line)
                if event is None:
                    continue
                if event.event == "drain":
                    return True
                if event.event == "delta":
                    self.timeline.append(("delta", int(json.loads(event.data)["epoch"])))
                elif event.id is not None:
                    self._keep(int(event.id), json.loads(event.data))
        return False

    def _keep(self, seq: int, payload: dict[str, Any]) -> None:
        self.seqs.append(seq)
        self.timeline.append((payload["kind"], payload["epoch"]))
        self.facts.append(
            CommittedFact(
                self.session_id,
                payload["seq"],
                payload["kind"],
                payload["data"],
                payload["timestamp"],
                payload["epoch"],
            )
        )
        self._changed.set()

    async def until(self, predicate: Callable[[list[CommittedFact]], bool], what: str) -> None:
        """Waits until the facts seen so far satisfy `predicate`."""
        # Woken by each fact the client reads, not polled (tests.support.polling),
        # and it stops as soon as the client itself fails.

        async def seen() -> None:
            while not predicate(self.facts):
                self._changed.clear()
                await self._changed.wait()

        waiting = asyncio.create_task(seen())
        watched = {waiting} if self.task is None else {waiting, self.task}
        await asyncio.wait(watched, timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        if self.task is not None and self.task.done():
            self.task.result()  # the client failed: its own error says why
        if not predicate(self.facts):
            kinds = [(f.seq, f.kind, f.epoch) for f in self.facts]
            raise AssertionError(f"the client never saw {what}; it saw {kinds}")

    async def answered(self, input_seq: int) -> None:
        await self.until(lambda facts: answered_in(facts, input_seq), f"the answer to {input_seq}")


def answered_in(facts: list[CommittedFact], input_seq: int) -> bool:
    return any(
        f.kind == "assistant" and input_seq in (f.data.get("inputSeqs") or ()) for f in facts
    )


@contextlib.asynccontextmanager
async def following(edges: list[EdgeServer], session_id: str) -> AsyncIterator[SseFollower]:
    """An SseFollower connected before the body runs, stopped after it."""
    follower = SseFollower(edges, session_id)
    task = follower.task = asyncio.create_task(follower.run(), name=f"sse-{session_id}")
    try:
        connected = asyncio.create_task(follower.connected.wait())
        await asyncio.wait(
            {task, connected}, timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED
        )
        connected.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await connected
        if task.done():
            task.result()
        assert follower.connected.is_set(), "the event stream did not open"
        yield follower
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
