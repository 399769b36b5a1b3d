"""`keel bench ledger`: durable appends through gRPC against a raw INSERT loop.

All three figures come from one run against one database, so they are
comparable with each other even on a noisy machine:

- `raw_insert_per_s`: a psycopg loop of one-row INSERT + COMMIT of rows shaped
  like the ledger's (what any hand-written store would pay per durable write);
- `single_session_per_s`: one session, one fact per append (the client's
  `AppendStream`), each durable before the next is sent;
- `concurrent_64_per_s`: 64 sessions appending at once, one fact per call;
- `single_session_unary_per_s`: the single-session loop over unary `Append`
  calls instead of the client's pipelined `AppendStream`;
- `cpu_us_per_append`: what each append cost in CPU, in the ledger process
  and in the client (less noisy than rates on a shared machine);
- `floor`: the one-session loop's floor (bench/grpc_floor.py): a Python
  gRPC round trip with nothing behind it, and with one INSERT + COMMIT
  behind it (on the event loop with psycopg's async connection, or in a
  writer thread), each against raw.

The ledger runs as its own OS process, as in production; the client is this
process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from bench.children import start_until_ready
from bench.grpc_floor import measure_floor
from services.common.config import Settings
from services.ledger import FactToAppend, LedgerClient

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


def raw_insert_loop(url: str, schema: str, count: int) -> float:
    payload = json.dumps({"kind": "input", "data": {"text": "x" * 100, "requestId": "r"}}).encode()
    with psycopg.connect(url) as conn:
        table = sql.Identifier(schema, "raw_events")
        # The very shape of the ledger's table (keys, indexes, defaults), so
        # the comparison is row for row.
        conn.execute(
            sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(
                table, sql.Identifier(schema, "ledger_events")
            )
        )
        conn.commit()
        insert = sql.SQL(
            "INSERT INTO {} (originator_id, originator_version, topic, state) "
            "VALUES (%s, %s, %s, %s)"
        ).format(table)
        started = time.perf_counter()
        for version in range(1, count + 1):
            conn.execute(insert, ("raw-session", version, "input", payload), prepare=True)
            conn.commit()
        return count / (time.perf_counter() - started)


def start_ledger(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc, line = start_until_ready(
        [sys.executable, "-m", "services.ledger", "--address", "127.0.0.1:0"],
        env,
        "ledger listening on ",
        "the ledger process",
    )
    return proc, line.split()[-1]


@dataclass(frozen=True)
class Phase:
    """One measured phase: appends per second, and the CPU each append cost
    the ledger process and this (client) process, in microseconds."""

    per_s: float
    ledger_cpu_us: float
    client_cpu_us: float


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        # Fields after the command name, which may itself hold spaces.
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Started at construction; `phase()` says what the appends since cost."""

    def __init__(self, ledger_pid: int) -> None:
        self._pid = ledger_pid
        self._wall = time.perf_counter()
        self._ledger_cpu = process_cpu_s(ledger_pid)
        self._client_cpu = time.process_time()

    def phase(self, appends: int) -> Phase:
        return Phase(
            per_s=appends / (time.perf_counter() - self._wall),
            ledger_cpu_us=(process_cpu_s(self._pid) - self._ledger_cpu) / appends * 1e6,
            client_cpu_us=(time.process_time() - self._client_cpu) / appends * 1e6,
        )


async def single_session(
    target: str, settings: Settings, count: int, ledger_pid: int, *, unary: bool = False
) -> Phase:
    """One session, each append durable before the next is sent: over the
    client's AppendStream, or (`unary`) one `Append` call each."""
    session_id = "bench-single-unary" if unary else "bench-single"
    async with LedgerClient(target, settings) as client:
        append = client.append_unary if unary else client.append
        await client.create_session(session_id, "bench")
        for i in range(50):  # warm-up: connections, prepared statements
            await append(session_id, [FactToAppend("input", {"text": "w", "requestId": f"w{i}"})])
        meter = CpuMeter(ledger_pid)
        for i in range(count):
            fact = FactToAppend("input", {"text": "x" * 100, "requestId": f"r{i}"})
            await append(session_id, [fact])
        return meter.phase(count)


async def concurrent_sessions(
    target: str, settings: Settings, sessions: int, per_session: int, ledger_pid: int
) -> Phase:
    async with LedgerClient(target, settings) as client:
        ids = [f"bench-c{i}" for i in range(sessions)]
        await asyncio.gather(*(client.create_session(s, "bench") for s in ids))

        async def writer(session_id: str) -> None:
            for i in range(per_session):
                await client.append_one(
                    session_id, "input", {"text": "x" * 100, "requestId": f"r{i}"}
                )

        meter = CpuMeter(ledger_pid)
        await asyncio.gather(*(writer(s) for s in ids))
        return meter.phase(sessions * per_session)


@dataclass(frozen=True)
class StandaloneLedger:
    """A ledger process on a throwaway schema, and what a client needs."""

    url: str
    schema: str
    target: str
    pid: int
    client_settings: Settings


@contextlib.contextmanager
def standalone_ledger(database_url: str | None) -> Iterator[StandaloneLedger]:
    """A ledger as its own OS process, as in production, on a new schema
    that is dropped afterwards."""
    url = database_url or os.environ.get("KEEL_DATABASE_URL") or DEFAULT_URL
    schema = f"keel_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    # Measured as deployed: every append carries and is checked for a token.
    client_settings = Settings(internal_token=secrets.token_urlsafe(32))
    env = dict(os.environ)
    env.update(
        {
            "KEEL_DATABASE_URL": url,
            "KEEL_PG_SCHEMA": schema,
            "KEEL_INTERNAL_TOKEN": client_settings.internal_token,
        }
    )
    env.setdefault("KEEL_DATA_DIR", tempfile.mkdtemp(prefix="keel-bench-"))
    proc, target = start_ledger(env)
    try:
        yield StandaloneLedger(url, schema, target, proc.pid, client_settings)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def measure(database_url: str | None = None, count: int = 2000) -> dict[str, Any]:
    with standalone_ledger(database_url) as ledger:
        target, pid, client_settings = ledger.target, ledger.pid, ledger.client_settings
        raw = raw_insert_loop(ledger.url, ledger.schema, count)
        single = asyncio.run(single_session(target, client_settings, count, pid))
        unary = asyncio.run(single_session(target, client_settings, count, pid, unary=True))
        concurrent = asyncio.run(
            concurrent_sessions(target, client_settings, 64, max(count // 32, 20), pid)
        )
        # An append request's size: one input fact of the loop above.
        payload = json.dumps({"kind": "input", "data": {"text": "x" * 100}}).encode()
        echo = measure_floor("echo", count, payload)
        commit = measure_floor("commit", count, payload, ledger.url, ledger.schema)
        thread = measure_floor("thread", count, payload, ledger.url, ledger.schema)
    return {
        "benchmark": "ledger",
        "database": "postgresql",
        "facts_per_run": count,
        "raw_insert_per_s": round(raw, 1),
        "single_session_per_s": round(single.per_s, 1),
        "concurrent_64_per_s": round(concurrent.per_s, 1),
        "single_vs_raw": round(single.per_s / raw, 3),
        "concurrent_vs_raw": round(concurrent.per_s / raw, 3),
        # The same single-session loop over unary `Append` calls, for comparison.
        "single_session_unary_per_s": round(unary.per_s, 1),
        # CPU per append, in microseconds, of the ledger process and the client.
        "cpu_us_per_append": {
            name: {"ledger": round(phase.ledger_cpu_us), "client": round(phase.client_cpu_us)}
            for name, phase in (
                ("single", single),
                ("single_unary", unary),
                ("concurrent_64", concurrent),
            )
        },
        # What one session's loop cannot beat in Python, whatever the ledger
        # does: a gRPC round trip alone, and with one durable write behind it.
        "floor": {
            "grpc_round_trip_per_s": round(echo, 1),
            "grpc_round_trip_us": round(1e6 / echo),
            "grpc_plus_commit_per_s": round(commit, 1),
            "grpc_plus_commit_vs_raw": round(commit / raw, 3),
            # The same write on a blocking connection in a writer thread.
            "grpc_plus_thread_commit_per_s": round(thread, 1),
            "grpc_plus_thread_commit_vs_raw": round(thread / raw, 3),
        },
        "targets": {"single_vs_raw": 0.5, "concurrent_vs_raw": 2.0},
    }


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else None), indent=2))
