"""`keel bench ledger`: durable appends through gRPC against a raw INSERT loop.

All three figures come from one run against one database, so they are
comparable with each other even on a noisy machine:

- `raw_insert_per_s`: a psycopg loop of one-row INSERT + COMMIT of rows shaped
  like the ledger's (what any hand-written store would pay per durable write);
- `single_session_per_s`: one session, one fact per gRPC `Append`, each durable
  before the next is sent;
- `concurrent_64_per_s`: 64 sessions appending at once, one fact per call.

The ledger runs as its own OS process, as in production; the client is this
process.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from services.common.config import Settings
from services.ledger import LedgerClient

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
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.ledger", "--address", "127.0.0.1:0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ledger listening on "):
            return proc, line.split()[-1]
    raise RuntimeError("the ledger process did not start")


async def single_session(target: str, settings: Settings, count: int) -> float:
    async with LedgerClient(target, settings) as client:
        await client.create_session("bench-single", "bench")
        for i in range(50):  # warm-up: connections, prepared statements
            await client.append_one("bench-single", "input", {"text": "w", "requestId": f"w{i}"})
        started = time.perf_counter()
        for i in range(count):
            await client.append_one(
                "bench-single", "input", {"text": "x" * 100, "requestId": f"r{i}"}
            )
        return count / (time.perf_counter() - started)


async def concurrent_sessions(
    target: str, settings: Settings, sessions: int, per_session: int
) -> float:
    async with LedgerClient(target, settings) as client:
        ids = [f"bench-c{i}" for i in range(sessions)]
        await asyncio.gather(*(client.create_session(s, "bench") for s in ids))

        async def writer(session_id: str) -> None:
            for i in range(per_session):
                await client.append_one(
                    session_id, "input", {"text": "x" * 100, "requestId": f"r{i}"}
                )

        started = time.perf_counter()
        await asyncio.gather(*(writer(s) for s in ids))
        return sessions * per_session / (time.perf_counter() - started)


def measure(database_url: str | None = None, count: int = 2000) -> dict[str, Any]:
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
        raw = raw_insert_loop(url, schema, count)
        single = asyncio.run(single_session(target, client_settings, count))
        concurrent = asyncio.run(
            concurrent_sessions(target, client_settings, 64, max(count // 32, 20))
        )
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return {
        "benchmark": "ledger",
        "database": "postgresql",
        "facts_per_run": count,
        "raw_insert_per_s": round(raw, 1),
        "single_session_per_s": round(single, 1),
        "concurrent_64_per_s": round(concurrent, 1),
        "single_vs_raw": round(single / raw, 3),
        "concurrent_vs_raw": round(concurrent / raw, 3),
        "targets": {"single_vs_raw": 0.5, "concurrent_vs_raw": 2.0},
    }


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1] if len(sys.argv) > 1 else None), indent=2))
