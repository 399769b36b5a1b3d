"""`keel bench e2e`: what a client of the edge sees, on PostgreSQL.

- `input_to_final.<transport>.p50_ms` / `p99_ms`: send an input, then time
  until the final answer's fact arrives on the session's stream (instant
  scripted model), through each front door measured (`--transport http`,
  `grpc`, or `both`): HTTP (POST, then the SSE frame) and gRPC (SendInput,
  then the StreamEvents message). With both, turns alternate between the two
  doors, so whatever else the machine does weighs on both alike.
- `sse_1000_clients_p99_ms` (with HTTP): 1000 SSE clients on one edge follow
  one session; a fact is committed to the ledger and each client's arrival
  time is measured from the commit. `sse_1000_clients_cpu_ms_per_fact` is the
  CPU time the `keel up` process (edge, ledger and all) spent per broadcast
  fact over those rounds: the cost behind the latency, less noisy than it on
  a shared machine.

The HTTP turn's client is an asyncio connection with a minimal SSE reader,
the gRPC one the generated stub; the 1000 followers share one epoll loop
(bench/followers.py), so the client side costs as little as possible on the
same 2-core machine.
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

import grpc
import httpx
import psycopg
from psycopg import sql

from bench.children import start_until_ready, stop_child
from bench.cluster import DEFAULT_URL
from bench.followers import Followers
from bench.turns import percentile
from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from services.runner.events import RUNNING

BENCH_KEY = "keel-bench-key-0123456789abcdef"
WARMUP_FACTS = 1
WARMUP_TURNS = 5
TRANSPORTS = ("http", "grpc")


class SseClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int, path: str, key: str) -> SseClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            # HTTP/1.0. uvicorn's httptools protocol still sends chunks; a
            # chunk's size line is neither a field nor blank: skipped below.
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


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its live children so
    far (Linux /proc): with `keel up --processes`, every service's."""
    with open(f"/proc/{pid}/stat") as stat:
        # The fields after the command name, which may itself hold spaces.
        fields = stat.read().rpartition(")")[2].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            children = [int(child) for child in listing.read().split()]
    except OSError:
        children = []
    return own + sum(process_cpu_s(child) for child in children)


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports (held open together while they are picked)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _start_keel(
    url: str, schema: str, port: int, grpc_port: int, processes: bool
) -> subprocess.Popen[str]:
    """`keel up` on PostgreSQL as its own process: the edge under test."""
    env = dict(os.environ)
    env.update(
        {
            "KEEL_PG_SCHEMA": schema,
            "KEEL_DEV_KEY": BENCH_KEY,
            "KEEL_LOG_LEVEL": "WARNING",
            "KEEL_RUNNER_CONCURRENCY": "16",
            # 1000 followers on one key: beyond the edge's default stream
            # limits, which keep one key from starving other tenants.
            "KEEL_EDGE_STREAMS_PER_KEY": "2000",
            "KEEL_EDGE_STREAMS_PER_TENANT": "2000",
        }
    )
    command = [
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
        "--grpc-port",
        str(grpc_port),
        "--processes" if processes else "--embedded",
    ]
    proc, _ = start_until_ready(command, env, "Keel is up", "keel up")
    return proc


class HttpTurns:
    """Turns through the HTTP API: POST the input, read SSE to the answer."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {BENCH_KEY}"}
        )
        self._session = ""
        self._stream: SseClient | None = None

    async def open(self) -> None:
        self._session = (await self._http.post("/v1/sessions", json={})).json()["id"]
        self._stream = await SseClient.open(
            self._port, f"/v1/sessions/{self._session}/events", BENCH_KEY
        )

    async def turn(self, text: str) -> None:
        assert self._stream is not None
        response = await self._http.post(
            f"/v1/sessions/{self._session}/inputs",
            json={"text": text, "requestId": uuid.uuid4().hex},
        )
        seq = response.json()["seq"]
        while True:
            kind, data = await self._stream.next_event()
            if kind == "assistant" and seq in (data["data"].get("inputSeqs") or ()):
                return

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
        await self._http.aclose()


class GrpcTurns:
    """Turns through keel.sessions.v1: SendInput, read StreamEvents to the answer."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.SessionServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {BENCH_KEY}"),)
        self._session = ""
        self._stream: Any = None

    async def open(self) -> None:
        created = await self._stub.CreateSession(pb.CreateSessionRequest(), metadata=self._metadata)
        self._session = created.session_id
        self._stream = self._stub.StreamEvents(
            pb.StreamEventsRequest(session_id=self._session), metadata=self._metadata
        )
        await self._stream.initial_metadata()

    async def turn(self, text: str) -> None:
        sent = await self._stub.SendInput(
            pb.SendInputRequest(session_id=self._session, text=text, request_id=uuid.uuid4().hex),
            metadata=self._metadata,
        )
        while True:
            event = await self._stream.read()
            if event is grpc.aio.EOF:  # type: ignore[attr-defined]
                raise ConnectionError("the event stream ended")
            if event.WhichOneof("event") != "fact" or event.fact.kind != "assistant":
                continue
            if sent.seq in (json.loads(event.fact.data_json).get("inputSeqs") or ()):
                return

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        await self._channel.close(None)


async def _time_turns(
    port: int, grpc_address: str, turns: int, transports: tuple[str, ...]
) -> dict[str, list[float]]:
    """Input -> final answer, per transport, turns alternating between them."""
    doors = {
        name: HttpTurns(port) if name == "http" else GrpcTurns(grpc_address) for name in transports
    }
    latencies: dict[str, list[float]] = {name: [] for name in transports}
    try:
        for door in doors.values():
            await door.open()
        for turn in range(turns + WARMUP_TURNS):
            for name, door in doors.items():
                started = time.perf_counter()
                await door.turn(f"turn {turn}")
                if turn >= WARMUP_TURNS:  # the first turns warm connections up
                    latencies[name].append((time.perf_counter() - started) * 1000)
    finally:
        for door in doors.values():
            await door.close()
    return latencies


async def _run(
    keel_pid: int,
    port: int,
    grpc_port: int,
    turns: int,
    clients: int,
    facts: int,
    transports: tuple[str, ...],
) -> dict[str, Any]:
    latencies = await _time_turns(port, f"127.0.0.1:{grpc_port}", turns, transports)
    result: dict[str, Any] = {
        "benchmark": "e2e",
        "database": "postgresql",
        "edge": "keel up (one process) on PostgreSQL; clients in another process",
        "transports": list(transports),
        "turns": turns,
        "input_to_final": {
            name: {
                "p50_ms": round(statistics.median(values), 2),
                "p99_ms": round(percentile(values, 0.99), 2),
            }
            for name, values in latencies.items()
        },
        "targets": {
            "input_to_final_p50_ms": 20,
            "input_to_final_p99_ms": 60,
            "sse_1000_clients_p99_ms": 50,
        },
    }
    if "http" in transports:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {BENCH_KEY}"}
        ) as http:
            followed = (await http.post("/v1/sessions", json={})).json()["id"]
            await _hold_the_session(http, followed)
        arrivals, cpu_s = await asyncio.to_thread(
            _time_broadcasts, keel_pid, port, followed, clients, facts
        )
        result["sse_clients"] = clients
        result["sse_1000_clients_p50_ms"] = round(statistics.median(arrivals), 2)
        result["sse_1000_clients_p99_ms"] = round(percentile(arrivals, 0.99), 2)
        result["sse_1000_clients_cpu_ms_per_fact"] = round(cpu_s * 1000 / facts, 2)
    return result


async def _hold_the_session(http: httpx.AsyncClient, session: str) -> None:
    """Keeps `session` busy with one answer far longer than the benchmark:
    the inputs it then times are committed and broadcast, and wait behind
    that answer, so no turn's deltas and facts compete with the broadcast
    being timed (a cancel would do the same, but on a session with nothing
    to cancel it commits nothing)."""
    body = {"text": "/slow 3600 hold", "requestId": "hold"}
    assert (await http.post(f"/v1/sessions/{session}/inputs", json=body)).status_code == 202
    deadline = time.monotonic() + 30
    while (await http.get(f"/v1/sessions/{session}")).json()["status"] != RUNNING:
        if time.monotonic() > deadline:
            raise RuntimeError("the held session never started running")
        await asyncio.sleep(0.05)


def _time_broadcasts(
    keel_pid: int, port: int, session: str, clients: int, facts: int
) -> tuple[list[float], float]:
    """Commit (an input, through the edge, to a session busy with a long
    answer) -> arrival at each of `clients` SSE clients of the session, over
    `facts` commits; and the CPU seconds `keel up` spent on those commits."""
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
            else:
                cpu_before = process_cpu_s(keel_pid)
        cpu_s = process_cpu_s(keel_pid) - cpu_before
    finally:
        followers.close()
    return arrivals, cpu_s


def transports_of(choice: str) -> tuple[str, ...]:
    """`--transport`: http, grpc or both."""
    if choice == "both":
        return TRANSPORTS
    if choice not in TRANSPORTS:
        raise ValueError(f"transport must be http, grpc or both, got {choice!r}")
    return (choice,)


def measure(
    database_url: str | None = None,
    turns: int = 100,
    clients: int = 1000,
    facts: int = 10,
    transport: str = "both",
    processes: bool = False,
) -> dict[str, Any]:
    transports = transports_of(transport)
    url = database_url or os.environ.get("KEEL_DATABASE_URL") or DEFAULT_URL
    schema = f"keel_bench_{uuid.uuid4().hex[:8]}"
    port, grpc_port = _free_ports(2)
    proc = _start_keel(url, schema, port, grpc_port, processes)
    try:
        result = asyncio.run(_run(proc.pid, port, grpc_port, turns, clients, facts, transports))
        if processes:
            result["edge"] = "keel up --processes on PostgreSQL; clients in another process"
        return result
    finally:
        stop_child(proc, timeout_s=30)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
