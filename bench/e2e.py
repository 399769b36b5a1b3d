"""`keel bench e2e`: what a client of the edge sees, on PostgreSQL.

- `input_to_final_p50_ms` / `_p99_ms`: POST an input, then time until the SSE
  frame of the final answer arrives (instant scripted model).
- `sse_1000_clients_p99_ms`: 1000 SSE clients on one edge follow one
  session; a fact is committed to the ledger and each client's arrival time
  is measured from the commit.

Clients are raw asyncio connections with a minimal SSE reader, so the client
side costs as little as possible on the same 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import httpx

from bench.cluster import start
from bench.turns import percentile
from services.ledger import LedgerClient


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
        await reader.readuntil(b"\r\n\r\n")  # status line and headers
        return cls(reader, writer)

    async def next_event(self) -> tuple[str, dict[str, Any]]:
        event, data = "message", ""
        while True:
            line = (await self.reader.readline()).decode().rstrip("\r\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
            elif line == "" and data:
                return event, json.loads(data)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def _run(database_url: str | None, turns: int, clients: int, facts: int) -> dict[str, Any]:
    cluster = await start(database_url, with_edge=True, concurrency=8)
    assert cluster.edge is not None
    port, key = cluster.edge.port, cluster.key
    latencies: list[float] = []
    arrivals: list[float] = []
    http = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}
    )
    try:
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        stream = await SseClient.open(port, f"/v1/sessions/{session}/events", key)
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

        followers = await asyncio.gather(
            *(
                SseClient.open(port, f"/v1/sessions/{session}/events?after=1000000", key)
                for _ in range(clients)
            )
        )
        async with LedgerClient(cluster.ledger.target) as ledger:
            for n in range(facts):

                async def arrive(client: SseClient) -> float:
                    while True:
                        kind, _ = await client.next_event()
                        if kind == "cancelled":
                            return time.perf_counter()

                waiting = [asyncio.create_task(arrive(c)) for c in followers]
                await asyncio.sleep(0)
                # From just before the commit: includes the append's own
                # latency, so the figure can only be pessimistic.
                committing = time.perf_counter()
                await ledger.append_one(session, "cancelled", {"reason": f"bench {n}"})
                for arrived in await asyncio.gather(*waiting):
                    arrivals.append((arrived - committing) * 1000)
        await asyncio.gather(*(c.close() for c in followers))
    finally:
        await http.aclose()
        await cluster.stop()
    return {
        "benchmark": "e2e",
        "database": "postgresql",
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


def measure(
    database_url: str | None = None, turns: int = 50, clients: int = 1000, facts: int = 10
) -> dict[str, Any]:
    return asyncio.run(_run(database_url, turns, clients, facts))
