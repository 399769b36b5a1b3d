"""The clients of a deployment being rolled: the edge Service, and for each
session an SSE reader and an input writer.

- `EdgeService` is what a client reaches through the keel-edge Service: the
  edge pods that are ready and not deleted (an edge leaves as soon as its
  pod is deleted, before its preStop runs, as Endpoints do), in turn.
- `SessionClient.follow` reads one session's event stream from its start
  across every reconnect: after `event: drain` it waits the
  `retry_after_ms` it was told and reconnects through the Service with
  `Last-Event-ID`; a broken connection is reconnected the same way. Every
  `id:` it is sent is kept, repeats and gaps included, for the checks.
- `SessionClient.write` sends inputs with request ids — a seeded mix of
  `/slow` answers and `counter` tool calls (with a `sleep` call beside, so
  a tool round lasts long enough for a drain to meet it), at most
  MAX_OUTSTANDING unanswered — until told to stop, then one last input. A POST that fails
  (no connection, a 5xx) is sent again through the Service with the same
  request id; every RESEND_EVERY-th input is sent twice, as by a client that
  lost the reply, and must get the same seq back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.cli.chat_view import SseParser

MAX_OUTSTANDING = 2
RESEND_EVERY = 5
THINK_S = (0.5, 2.5)
SLOW_S = (0.5, 1.0, 1.5)
TOOL_SHARE = 0.35
TOOL_SLEEP_S = 1.0
WORDS = ("keel", "lease", "epoch", "fence", "ledger", "drain", "claim", "handoff")
# Between two tries of a failed request or connection (a client's backoff).
BACKOFF_S = 0.2
DEADLINE_S = 60.0
# A client reconnecting this often has met an edge that keeps ending its
# streams: a bug, not a rollout.
MAX_RECONNECTS = 20


class NoEndpoint(Exception):
    """No edge is ready behind the Service."""


class EdgeService:
    """The keel-edge Service's endpoints (edge base URLs)."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self._turn = 0

    def add(self, url: str) -> None:
        self.urls.append(url)

    def remove(self, url: str) -> None:
        self.urls.remove(url)

    def pick(self) -> str:
        if not self.urls:
            raise NoEndpoint("the keel-edge Service has no ready endpoint")
        self._turn += 1
        return self.urls[self._turn % len(self.urls)]


@dataclass
class SessionClient:
    session_id: str
    service: EdgeService
    http: httpx.AsyncClient
    rng: random.Random
    # Every `id:` the stream sent, in order, across reconnects.
    seqs: list[int] = field(default_factory=list)
    # request id -> the seq the edge acknowledged.
    acked: dict[str, int] = field(default_factory=dict)
    # Input seqs some assistant fact the client was sent answered.
    answered: set[int] = field(default_factory=set)
    drains: int = 0
    reconnects: int = 0
    # POSTs sent again after a failure, and on purpose (a lost reply).
    retries: int = 0
    resends: int = 0
    # The edge each connection of the stream went to.
    edges: list[str] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    # -- the event stream --

    async def follow(self) -> None:
        """Reads the stream until cancelled."""
        while True:
            try:
                pause = await self._one_stream(self.service.pick())
            except (httpx.TransportError, NoEndpoint):
                pause = BACKOFF_S
            self.reconnects += 1
            assert self.reconnects <= MAX_RECONNECTS, f"{self.session_id}: too many reconnects"
            await asyncio.sleep(pause)  # retry_after_ms, or a backoff

    async def _one_stream(self, url: str) -> float:
        """One connection to its end; how long to wait before the next."""
        headers = {"Accept": "text/event-stream", "Last-Event-ID": str(self.last_seq)}
        self.edges.append(url)
        parser = SseParser()
        path = f"{url}/v1/sessions/{self.session_id}/events"
        async with self.http.stream("GET", path, headers=headers, timeout=None) as response:
            if response.status_code >= 500:
                return BACKOFF_S  # an edge on its way out
            assert response.status_code == 200, (await response.aread()).decode()
            async for line in response.aiter_lines():
                event = parser.feed(line)
                if event is None:
                    continue
                if event.event == "drain":
                    self.drains += 1
                    return float(json.loads(event.data)["retry_after_ms"]) / 1000
                if event.id is not None:
                    self._keep(int(event.id), json.loads(event.data))
        return BACKOFF_S

    @property
    def last_seq(self) -> int:
        return self.seqs[-1] if self.seqs else 0

    def _keep(self, seq: int, fact: dict[str, Any]) -> None:
        self.seqs.append(seq)
        if fact["kind"] == "assistant":
            self.answered.update(fact["data"].get("inputSeqs") or ())
        self._changed.set()

    async def changed(self, timeout_s: float) -> None:
        """Waits for the next fact the stream sends (or the timeout)."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    @property
    def unanswered(self) -> set[int]:
        return set(self.acked.values()) - self.answered

    async def until_answered(self, deadline_s: float = DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while self.unanswered:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.session_id}: inputs {sorted(self.unanswered)} never answered "
                    f"on the stream (last seq {self.last_seq})"
                )
            await self.changed(deadline - time.monotonic())

    # -- inputs --

    def next_text(self) -> str:
        if self.rng.random() < TOOL_SHARE:
            counter = json.dumps({"key": self.session_id})
            return f"/tool counter {counter} | sleep {json.dumps({'seconds': TOOL_SLEEP_S})}"
        words = " ".join(self.rng.choice(WORDS) for _ in range(6))
        return f"/slow {self.rng.choice(SLOW_S)} {words}"

    async def write(self, stop: asyncio.Event) -> None:
        """Inputs until `stop`, then one more (answered after the rollout)."""
        sent = 0
        while not stop.is_set():
            while len(self.unanswered) >= MAX_OUTSTANDING and not stop.is_set():
                await self.changed(1.0)
            if stop.is_set():
                break
            await self.send(self.next_text(), sent)
            sent += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.rng.uniform(*THINK_S))
        await self.send(f"after the rollout, input {sent}", sent)

    async def send(self, text: str, number: int) -> int:
        request_id = f"{self.session_id}-{number}"
        seq, _ = await self._post(request_id, text)
        self.acked[request_id] = seq
        if number % RESEND_EVERY == RESEND_EVERY - 1:
            self.resends += 1
            again, status = await self._post(request_id, text)
            assert (again, status) == (seq, 200), (request_id, seq, again, status)
        return seq

    async def _post(self, request_id: str, text: str) -> tuple[int, int]:
        """(seq, status) of the input, sent until an edge answers it."""
        body = {"text": text, "requestId": request_id}
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                url = self.service.pick()
                response = await self.http.post(
                    f"{url}/v1/sessions/{self.session_id}/inputs", json=body
                )
            except (httpx.TransportError, NoEndpoint):
                response = None
            if response is not None and response.status_code in (200, 202):
                return int(response.json()["seq"]), response.status_code
            if response is not None and response.status_code < 500:
                raise AssertionError(f"{request_id}: {response.status_code} {response.text}")
            assert time.monotonic() < deadline, f"{request_id}: no edge took it"
            self.retries += 1
            await asyncio.sleep(BACKOFF_S)
