"""`keel bench replicas`: inputs accepted while a ledger replica is SIGKILLed.

`keel up --processes --ledgers 2 --kernels 2` on a throwaway PostgreSQL
schema, driven through its HTTP API by `InputLoad` (sessions posting inputs
continuously, each retried with its own request id on a retryable failure).
Once the load flows, the supervisor's `ledger-1` process is SIGKILLed; the
other replica keeps serving while the supervisor starts a new one.

Figures per run (acknowledgements counted by the time they arrived):
- `before_inputs_per_s`: over the `window_s` before the kill;
- `during_kill_inputs_per_s`: over the `window_s` from the kill on;
- `until_restarted_inputs_per_s`: from the kill until the new `ledger-1`
  is ready (`restart_ms` after the kill);
- `retryable_failures`: 503s and broken connections the clients retried;
  `unexpected` counts any other failure (a 500 would be one);
- `violations` / `duplicates`: `keel chaos`'s rules over every session once
  all is answered, plus every acknowledged request id being one input.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from bench.cluster import DEFAULT_URL
from bench.input_load import InputLoad, settled_violations
from services.session_invariants import duplicates

BENCH_KEY = "bench-replicas-key-0123456789abcdef"
VICTIM = "ledger-1"
START_DEADLINE_S = 120.0
# Acknowledged inputs seen before the window before the kill opens.
WARM_UP = 20


class SupervisedKeel:
    """`keel up --processes --ledgers 2 --kernels 2` and what it prints."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def launch(
        cls,
        database_url: str,
        schema: str,
        key: str,
        up_args: Sequence[str],
        *,
        data_dir_prefix: str = "keel-bench-",
        **settings: str,
    ) -> SupervisedKeel:
        """`keel up --processes UP_ARGS` on PostgreSQL (its own `schema`) with
        dev key `key`, any free ports and `settings` in its environment; it
        makes its own internal token."""
        env = {k: v for k, v in os.environ.items() if k != "KEEL_INTERNAL_TOKEN"}
        env.update(
            KEEL_DATABASE_URL=database_url,
            KEEL_PG_SCHEMA=schema,
            KEEL_DEV_KEY=key,
            KEEL_LOG_LEVEL="WARNING",
            PYTHONUNBUFFERED="1",
            **settings,
        )
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "services.cli.main", "up", "--processes", *up_args),
            *("--data-dir", tempfile.mkdtemp(prefix=data_dir_prefix)),
            *("--http-port", "0", "--grpc-port", "0"),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        return cls(process)

    @classmethod
    async def start(cls, database_url: str, schema: str, lease_ms: int) -> SupervisedKeel:
        return await cls.launch(
            database_url,
            schema,
            BENCH_KEY,
            ("--ledgers", "2", "--kernels", "2"),
            KEEL_LEASE_MS=str(lease_ms),
        )

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())
            self._changed.set()
        self._changed.set()

    async def line(self, pattern: re.Pattern[str], deadline_s: float) -> re.Match[str]:
        """The first line matching `pattern` (read from the start)."""
        deadline = time.monotonic() + deadline_s
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if found := pattern.match(line):
                    return found
            seen = len(self.lines)
            if self._reader.done() or time.monotonic() > deadline:
                tail = "\n".join(self.lines[-30:])
                raise RuntimeError(f"keel up printed no {pattern.pattern!r}:\n{tail}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 1)

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 60)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        self._reader.cancel()


async def _run_once(
    database_url: str, sessions: int, window_s: float, lease_ms: int
) -> dict[str, Any]:
    schema = f"keel_bench_{uuid.uuid4().hex[:8]}"
    keel = await SupervisedKeel.start(database_url, schema, lease_ms)
    try:
        url = (await keel.line(re.compile(r"^Keel is up: (http://[^/]+)/"), START_DEADLINE_S))[1]
        pid = int((await keel.line(re.compile(rf"^\s*{VICTIM}: pid (\d+)$"), 1))[1])
        load = InputLoad(url, BENCH_KEY, sessions, pause_s=0.02, redeliver_every=10)
        try:
            await load.open()
            load.start()
            tally = load.tally
            await asyncio.wait_for(load.acknowledged(WARM_UP), START_DEADLINE_S)
            await asyncio.sleep(window_s)
            failed_before = sum(tally.retryable.values())
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            ready = re.compile(rf"^\s*{VICTIM} \(pid (?!{pid}\)).*\) is ready$")
            await keel.line(ready, START_DEADLINE_S)
            restarted_at = time.monotonic()
            await asyncio.sleep(max(0.0, killed_at + window_s - time.monotonic()))
            retryable = sum(tally.retryable.values()) - failed_before
            await load.stop()
            violations, facts = await settled_violations(load, 120)
        finally:
            await load.close()
    finally:
        await keel.stop()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    restart_s = restarted_at - killed_at
    return {
        "before_inputs_per_s": round(
            tally.accepted_between(killed_at - window_s, killed_at) / window_s, 1
        ),
        "during_kill_inputs_per_s": round(
            tally.accepted_between(killed_at, killed_at + window_s) / window_s, 1
        ),
        "until_restarted_inputs_per_s": round(
            tally.accepted_between(killed_at, restarted_at) / restart_s, 1
        ),
        "restart_ms": round(restart_s * 1000, 1),
        "retryable_failures": retryable,
        "unexpected": len(tally.unexpected),
        "acknowledged": len(tally.acknowledged),
        "inputs_in_ledger": sum(
            1 for session in facts.values() for f in session if f["kind"] == "input"
        ),
        "violations": len(violations),
        "duplicates": duplicates(violations),
    }


def measure(
    database_url: str | None = None,
    runs: int = 3,
    sessions: int = 8,
    window_s: float = 3.0,
    lease_ms: int = 5000,
) -> dict[str, Any]:
    url = database_url or os.environ.get("KEEL_DATABASE_URL") or DEFAULT_URL
    results = [asyncio.run(_run_once(url, sessions, window_s, lease_ms)) for _ in range(runs)]
    during = [r["during_kill_inputs_per_s"] for r in results]
    return {
        "benchmark": "replicas",
        "ledgers": 2,
        "kernels": 2,
        "killed": VICTIM,
        "sessions": sessions,
        "window_s": window_s,
        "during_kill_inputs_per_s_median": statistics.median(during),
        "before_inputs_per_s_median": statistics.median(r["before_inputs_per_s"] for r in results),
        "runs": results,
    }
