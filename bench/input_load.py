"""Sessions kept busy with inputs through the public HTTP API, as a careful
client sends them: each input has its own request id, and a retryable
failure (502/503/504 or a broken connection) is retried with the SAME
request id until it is acknowledged, so a retry can never add an input.

Used by `keel bench replicas` and by the tests that SIGKILL services under
load: they read what was acknowledged (`Acknowledged`, with the time), what
failed retryably, and anything else the edge answered (a 500 is a bug).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.cli.chaos import EdgeApi
from services.session_invariants import Violation, check_session

RETRYABLE_STATUSES = frozenset({502, 503, 504})
# A retry waits this long first: about what a 503's Retry-After asks.
RETRY_PAUSE_S = 0.1
# A request that hangs this long is a failure in its own right.
REQUEST_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Acknowledged:
    session: str
    request_id: str
    seq: int
    # time.monotonic() when the acknowledgement arrived.
    at: float
    # How many attempts it took (1: no retry).
    attempts: int


@dataclass
class LoadTally:
    acknowledged: list[Acknowledged] = field(default_factory=list)
    # Retryable failures, by status (0: no HTTP answer at all).
    retryable: Counter[int] = field(default_factory=Counter)
    # Anything that is neither an acknowledgement nor retryable.
    unexpected: list[str] = field(default_factory=list)
    # Acknowledged inputs re-sent on purpose with their request id whose
    # answer was not the first one's seq (a duplicate through the dedup).
    redelivery_mismatches: list[str] = field(default_factory=list)
    redeliveries: int = 0

    def accepted_between(self, start: float, end: float) -> int:
        return sum(1 for a in self.acknowledged if start <= a.at < end)


class InputLoad:
    """`sessions` sessions, each posting an input every `pause_s` while running.

    Every `redeliver_every`-th acknowledged input of a session is posted once
    more with its request id: the edge must answer 200 with the same seq
    (with replicas, the copy may well reach another ledger process)."""

    def __init__(
        self,
        url: str,
        key: str,
        sessions: int,
        *,
        pause_s: float = 0.1,
        text: Callable[[int], str] = lambda n: f"hello {n}",
        redeliver_every: int = 5,
    ) -> None:
        self._api = EdgeApi(url, key)
        self._http = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=REQUEST_TIMEOUT_S,
        )
        self._count = sessions
        self._pause_s = pause_s
        self._text = text
        self._redeliver_every = redeliver_every
        self.sessions: list[str] = []
        self.tally = LoadTally()
        self._stop = asyncio.Event()
        self._acknowledged = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        for _ in range(self._count):
            self.sessions.append((await self._api.call("POST", "/v1/sessions", json={}))["id"])

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._drive(s)) for s in self.sessions]

    async def acknowledged(self, count: int) -> None:
        """Returns once `count` inputs have been acknowledged in all."""
        while len(self.tally.acknowledged) < count:
            self._acknowledged.clear()
            await self._acknowledged.wait()

    async def stop(self) -> None:
        """Stops posting new inputs; one still being retried is finished."""
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def close(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.aclose()
        await self._api.close()

    async def _drive(self, session: str) -> None:
        number = 0
        while not self._stop.is_set():
            number += 1
            request_id = f"{session}-in-{number}"
            text = self._text(number)
            acknowledged = await self._post(session, request_id, text)
            if acknowledged is not None and number % self._redeliver_every == 0:
                await self._redeliver(acknowledged, text)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._pause_s)

    async def _post(self, session: str, request_id: str, text: str) -> Acknowledged | None:
        """Posts until acknowledged (a retryable failure is retried with the
        same request id); None if the edge refused it for good."""
        body = {"text": text, "requestId": request_id}
        attempts = 0
        while True:
            attempts += 1
            status, answer = await self._send(session, body)
            if status in (200, 202):
                acknowledged = Acknowledged(
                    session, request_id, int(answer["seq"]), time.monotonic(), attempts
                )
                self.tally.acknowledged.append(acknowledged)
                self._acknowledged.set()
                return acknowledged
            if status in RETRYABLE_STATUSES or status == 0:
                self.tally.retryable[status] += 1
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            self.tally.unexpected.append(f"{request_id}: {status} {answer}")
            return None

    async def _send(self, session: str, body: dict[str, str]) -> tuple[int, Any]:
        try:
            response = await self._http.post(f"/v1/sessions/{session}/inputs", json=body)
        except httpx.TransportError:
            return 0, None
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, response.text[:200]

    async def _redeliver(self, first: Acknowledged, text: str) -> None:
        # The same text: another with this request id is refused as a conflict.
        body = {"text": text, "requestId": first.request_id}
        while not self._stop.is_set():
            status, answer = await self._send(first.session, body)
            if status in RETRYABLE_STATUSES or status == 0:
                self.tally.retryable[status] += 1
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            self.tally.redeliveries += 1
            if status != 200 or answer.get("seq") != first.seq:
                self.tally.redelivery_mismatches.append(
                    f"{first.request_id} (seq {first.seq}): {status} {answer}"
                )
            return

    async def facts(self, session: str) -> list[dict[str, Any]]:
        return await self._api.facts(session)


async def settled_violations(
    load: InputLoad, deadline_s: float
) -> tuple[list[Violation], dict[str, list[dict[str, Any]]]]:
    """Waits (up to `deadline_s`) until every session has answered all its
    inputs, then checks each session's whole ledger with `keel chaos`'s
    rules, and that every acknowledged request id is one input at its seq.
    Returns the violations (empty when all is well) and the facts read."""
    deadline = time.monotonic() + deadline_s
    while True:
        facts = {s: await load.facts(s) for s in load.sessions}
        pending = [
            v
            for s, f in facts.items()
            for v in check_session(s, f, settled=True)
            if v.rule == "unanswered_input"
        ]
        if not pending or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    violations = [v for s, f in facts.items() for v in check_session(s, f, settled=True)]
    violations += _acknowledged_once(load.tally.acknowledged, facts)
    return violations, facts


def _acknowledged_once(
    acknowledged: list[Acknowledged], facts: dict[str, list[dict[str, Any]]]
) -> list[Violation]:
    found: list[Violation] = []
    for session, session_facts in facts.items():
        inputs = Counter(f["data"].get("requestId") for f in session_facts if f["kind"] == "input")
        by_seq = {f["seq"]: f for f in session_facts}
        for request_id, count in inputs.items():
            if count > 1:
                found.append(Violation(session, 0, "duplicate_input", f"{request_id} x{count}"))
        for ack in (a for a in acknowledged if a.session == session):
            fact = by_seq.get(ack.seq)
            if (
                fact is None
                or fact["kind"] != "input"
                or fact["data"].get("requestId") != (ack.request_id)
            ):
                found.append(
                    Violation(session, ack.seq, "lost_input", f"{ack.request_id} not at its seq")
                )
    return found
