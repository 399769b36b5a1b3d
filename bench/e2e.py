"""`keel bench e2e`: what a client of the edge sees, on PostgreSQL.

- `input_to_final_p50_ms` / `_p99_ms`: POST an input, then time until the SSE
  frame of the final answer arrives (instant scripted model).
- `sse_1000_clients_p99_ms`: 1000 SSE clients on one edge follow one
  session; a fact is committed to the ledger and each client's arrival time
  is measured from the commit.

The turn's client is an asyncio connection with a minimal SSE reader; the
1000 followers share one epoll loop (bench/followers.py), so the client side
costs as little as possible on the same 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import httpx
import psycopg
from psycopg import sql

from bench.cluster import DEFAULT_URL
from bench.followers import Followers
from bench.turns import percentile

BENCH_KEY = "keel-bench-key"
WARMUP_FACTS = 1


class SseClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int, path: str, key: str) -> SseClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            # HTTP/1.0: no chunked framing to undo, the stream just flows.
            f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")  # status line and headers
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            body = await reader.read(4096)
            raise RuntimeError(f"SSE request refused: {head.decode(errors='replace')}{body!r}")
        return cls(reader, writer)

    async def next_event(self) -> tuple[str, dict[str, Any]]:
        event, data = "message", ""
        while True:
            raw = await self.reader.readline()
            if not raw:
                raise ConnectionError("the SSE stream ended")
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
            elif line == "" and data:
                return event, json.loads(data)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_keel(url: str, schema: str, port: int) -> subprocess.Popen[str]:
    """`keel up` on PostgreSQL as its own process: the edge under test."""
    env = dict(os.environ)
    env.update(
        {
            "KEEL_PG_SCHEMA": schema,
            "KEEL_DEV_KEY": BENCH_KEY,
            "KEEL_LOG_LEVEL": "WARNING",
            "KEEL_RUNNER_CONCURRENCY": "16",
        }
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "up",
            "--database-url",
            url,
            "--data-dir",
            tempfile.mkdtemp(prefix="keel-bench-"),
            "--http-port",
            str(port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("Keel is up"):
            return proc
    raise RuntimeError("keel up did not start")


async def _run(url: str, port: int, turns: int, clients: int, facts: int) -> dict[str, Any]:
    latencies: list[float] = []
    arrivals: list[float] = []
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {BENCH_KEY}"}
    ) as http:
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        stream = await SseClient.open(port, f"/v1/sessions/{session}/events", BENCH_KEY)
        for turn in range(turns + 5):
            started = time.perf_counter()
            response = await http.post(
                f"/v1/sessions/{session}/inputs",
                json={"text": f"turn {turn}", "requestId": uuid.uuid4().hex},
            )
            seq = response.json()["seq"]
            while True:
                kind, data = await stream.next_event()
                if kind == "assistant" and seq in (data["data"].get("inputSeqs") or ()):
                    break
            if turn >= 5:  # the first turns warm connections up
                latencies.append((time.perf_counter() - started) * 1000)
        await stream.close()

        followed = (await http.post("/v1/sessions", json={})).json()["id"]
    arrivals = await asyncio.to_thread(_time_broadcasts, port, followed, clients, facts)
    return {
        "benchmark": "e2e",
        "database": "postgresql",
        "edge": "keel up (one process) on PostgreSQL; clients in another process",
        "input_to_final_p50_ms": round(statistics.median(latencies), 2),
        "input_to_final_p99_ms": round(percentile(latencies, 0.99), 2),
        "sse_clients": clients,
        "sse_1000_clients_p50_ms": round(statistics.median(arrivals), 2),
        "sse_1000_clients_p99_ms": round(percentile(arrivals, 0.99), 2),
        "targets": {
            "input_to_final_p50_ms": 20,
            "input_to_final_p99_ms": 60,
            "sse_1000_clients_p99_ms": 50,
        },
    }


def _time_broadcasts(port: int, session: str, clients: int, facts: int) -> list[float]:
    """Commit (an input, through the edge) -> arrival at each of `clients`
    SSE clients of the session, over `facts` commits."""
    followers = Followers(port, f"/v1/sessions/{session}/events?after=1", BENCH_KEY, clients)
    arrivals: list[float] = []
    try:
        # The first rounds are not measured: a client's request returns its
        # headers before the edge has read its backlog, so the first fact
        # would time 1000 clients still attaching, not the broadcast.
        for round_ in range(facts + WARMUP_FACTS):
            # Timed from just before the POST: the request's own latency is
            # included, so the figure is pessimistic.
            body = json.dumps({"text": f"broadcast {round_}", "requestId": f"b-{round_}"})
            arrived = followers.post_and_time(
                f"/v1/sessions/{session}/inputs", body.encode(), "input"
            )
            if round_ >= WARMUP_FACTS:
                arrivals.extend(arrived)
    finally:
        followers.close()
    return arrivals


def measure(
    database_url: str | None = None, turns: int = 100, clients: int = 1000, facts: int = 10
) -> dict[str, Any]:
    url = database_url or os.environ.get("KEEL_DATABASE_URL") or DEFAULT_URL
    schema = f"keel_bench_{uuid.uuid4().hex[:8]}"
    port = _free_port()
    proc = _start_keel(url, schema, port)
    try:
        return asyncio.run(_run(url, port, turns, clients, facts))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
