"""`keel bench soak`: how fast an input is accepted while answers queue.

`keel up --processes --runners 2` on a throwaway PostgreSQL schema; `sessions`
sessions each post an input (`/slow answer_s`: a streamed answer that takes
that long) every ~`interval_s` (jittered) for `duration_s`,
each with an SSE reader on its session's events. With the tenant's run slots
(8 by default) all busy, answers queue behind them: the figure is how long
`POST /v1/sessions/{id}/inputs` takes to answer 202 meanwhile, which must not
depend on that backlog. Once the posting stops, every session is waited on
until all is answered, and `keel chaos`'s rules check each ledger: every
acknowledged input answered exactly once.

Figures: `post_p50_ms`, `post_p99_ms`, `post_max_ms` over every POST;
`answered_within_s` from the end of posting until all was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import statistics
import time
import uuid
from typing import Any

import httpx
import psycopg
from psycopg import sql

from bench.cluster import DEFAULT_URL
from bench.e2e import SseClient
from bench.input_load import REQUEST_TIMEOUT_S, RETRYABLE_STATUSES
from bench.replicas import SupervisedKeel
from bench.turns import percentile
from services.cli.chaos import EdgeApi
from services.session_invariants import check_session, duplicates

BENCH_KEY = "keel-bench-soak-key-0123456789abcdef"
START_DEADLINE_S = 120.0
# How long each answer streams (`/slow`): 8 run slots answer at most
# 8 / ANSWER_S turns a second, fewer than the sessions ask for, so answers
# queue behind the slots (a turn answers all of a session's owed inputs).
ANSWER_S = 0.2
# How long the answers may take to drain once posting stops.
SETTLE_DEADLINE_S = 300.0


async def _start(database_url: str, schema: str, runners: int) -> SupervisedKeel:
    return await SupervisedKeel.launch(
        database_url,
        schema,
        BENCH_KEY,
        ("--runners", str(runners)),
        data_dir_prefix="keel-bench-soak-",
        # One reader per session on one key: beyond the per-key default.
        KEEL_EDGE_STREAMS_PER_KEY="2000",
        KEEL_EDGE_STREAMS_PER_TENANT="2000",
    )


class _Soak:
    def __init__(self, url: str, sessions: int, interval_s: float, answer_s: float) -> None:
        self._url = url
        self._port = int(url.rsplit(":", 1)[1])
        self._count = sessions
        self._interval_s = interval_s
        self._answer_s = answer_s
        self._http = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {BENCH_KEY}"},
            timeout=REQUEST_TIMEOUT_S * 4,
            limits=httpx.Limits(max_connections=sessions + 10),
        )
        self.sessions: list[str] = []
        self.post_ms: list[float] = []
        self.retryable = 0
        self.unexpected: list[str] = []
        self.frames = 0
        self._stop = asyncio.Event()

    async def open(self) -> list[SseClient]:
        readers = []
        for _ in range(self._count):
            created = await self._http.post("/v1/sessions", json={})
            session = created.json()["id"]
            self.sessions.append(session)
            path = f"/v1/sessions/{session}/events"
            readers.append(await SseClient.open(self._port, path, BENCH_KEY))
        return readers

    async def read(self, reader: SseClient) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                await reader.next_event()
                self.frames += 1

    async def post(self, session: str) -> None:
        # Spread the sessions' first inputs over one interval.
        await self._pause(random.uniform(0, self._interval_s))
        number = 0
        while not self._stop.is_set():
            number += 1
            text = f"/slow {self._answer_s} soak {number}"
            body = {"text": text, "requestId": f"{session}-soak-{number}"}
            while True:
                started = time.perf_counter()
                try:
                    response = await self._http.post(f"/v1/sessions/{session}/inputs", json=body)
                except httpx.TransportError:
                    self.retryable += 1
                    continue
                self.post_ms.append((time.perf_counter() - started) * 1000)
                if response.status_code in RETRYABLE_STATUSES:
                    self.retryable += 1
                    continue
                if response.status_code not in (200, 202):
                    self.unexpected.append(f"{response.status_code} {response.text[:200]}")
                break
            await self._pause(self._interval_s * random.uniform(0.8, 1.2))

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    def stop(self) -> None:
        self._stop.set()

    async def settled(self, deadline_s: float) -> tuple[float, list[Any]]:
        """Waits until every input is answered; (seconds it took, violations)."""
        api = EdgeApi(self._url, BENCH_KEY)
        started = time.monotonic()
        try:
            while True:
                facts = {s: await api.facts(s) for s in self.sessions}
                violations = [
                    v for s, f in facts.items() for v in check_session(s, f, settled=True)
                ]
                pending = [v for v in violations if v.rule == "unanswered_input"]
                if not pending or time.monotonic() - started > deadline_s:
                    return time.monotonic() - started, violations
                await asyncio.sleep(1.0)
        finally:
            await api.close()

    async def close(self) -> None:
        await self._http.aclose()


async def _run(
    database_url: str,
    sessions: int,
    interval_s: float,
    answer_s: float,
    duration_s: float,
    runners: int,
) -> dict[str, Any]:
    schema = f"keel_bench_{uuid.uuid4().hex[:8]}"
    keel = await _start(database_url, schema, runners)
    try:
        url = (await keel.line(re.compile(r"^Keel is up: (http://[^/]+)/"), START_DEADLINE_S))[1]
        soak = _Soak(url, sessions, interval_s, answer_s)
        readers = await soak.open()
        reading = [asyncio.create_task(soak.read(r)) for r in readers]
        posting = [asyncio.create_task(soak.post(s)) for s in soak.sessions]
        await asyncio.sleep(duration_s)
        soak.stop()
        await asyncio.gather(*posting)
        settle_s, violations = await soak.settled(SETTLE_DEADLINE_S)
        for task in reading:
            task.cancel()
        for reader in readers:
            with contextlib.suppress(OSError):
                await reader.close()
        await soak.close()
    finally:
        await keel.stop()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    posts = soak.post_ms
    return {
        "posts": len(posts),
        "post_p50_ms": round(statistics.median(posts), 1),
        "post_p99_ms": round(percentile(posts, 0.99), 1),
        "post_max_ms": round(max(posts), 1),
        "retryable": soak.retryable,
        "unexpected": len(soak.unexpected),
        "sse_frames": soak.frames,
        "answered_within_s": round(settle_s, 1),
        "violations": len(violations),
        "duplicates": duplicates(violations),
    }


def measure(
    database_url: str | None = None,
    sessions: int = 200,
    interval_s: float = 3.0,
    answer_s: float = ANSWER_S,
    duration_s: float = 60.0,
    runners: int = 2,
) -> dict[str, Any]:
    url = database_url or os.environ.get("KEEL_DATABASE_URL") or DEFAULT_URL
    result = asyncio.run(_run(url, sessions, interval_s, answer_s, duration_s, runners))
    return {
        "benchmark": "soak",
        "edge": f"keel up --processes --runners {runners} on PostgreSQL",
        "sessions": sessions,
        "interval_s": interval_s,
        "answer_s": answer_s,
        "duration_s": duration_s,
        **result,
    }
