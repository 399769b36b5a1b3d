"""`keel bench drain`: a handoff drain of a runner holding N running sessions
(SPEC §8: 100 sessions, all released and reclaimed ≤ 10 s, 0 duplicates).

Every service is its own OS process, as deployed (`keel ledger`, `keel
kernel`, two `keel runner`s), on a throwaway PostgreSQL schema; this process
only drives them. Runner A claims every session; runner B starts once A
holds them all (the tenant's admission and A's concurrency allow all N at
once, and B can take nothing while A holds the leases); A is then drained
in handoff mode over its gRPC API, as `keel drain --local` does in a pod's
preStop.

The workload: each session runs one input calling the `sleep` tool many
times in a row (60 calls of 1 s by default), so every session is still
running when B is up (B has the length of the chain to start), and the next
commit boundary is never more than a step away: a busy runner, committing
one fact per session per second. (A slow answer has no boundary inside its
stream: a handoff waits for it to end, and the figure would time the
answer, not the handoff.) Once every successor has committed its first
fact, the sessions are cancelled, so the bench does not wait out the chains.

Figures, all from the drain request (`t0`) and the ledger's commit times:
- `released_ms`: until the drain call returned (every attempt settled at a
  boundary and gave its session back);
- `reclaimed_ms` (target ≤ 10 s) / `reclaimed_p50_ms`: until every (the
  median) session's successor committed its first fact (`epoch_started` by B);
- `handoff_gap_p50_ms` / `handoff_gap_max_ms`: per session, from A's last
  fact to B's first: the handoff itself, without the step A finished first;
- `duplicates` (target 0): answers or tool results committed twice, found by
  `keel chaos`'s checks over every session's whole ledger; `violations`
  counts every broken rule (a lost input included).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.cluster import DEFAULT_URL
from bench.turns import percentile
from edge.streams import fact_json
from kernel import KernelClient
from services.common.config import Settings
from services.common.internal_auth import TOKEN_ENV
from services.ledger import CommittedFact, LedgerClient
from services.runner.client import RunnerClient
from services.session_invariants import Violation, check_session, duplicates

TENANT = "default"
START_DEADLINE_S = 120.0
# Waits that only fail a hung bench (the figures are timed separately).
WAIT_DEADLINE_S = 300.0
DRAIN_DEADLINE_MS = 30_000


class ServiceProcess:
    """A `keel <service>` child, once it serves; its output is read (and
    kept) as it comes, so a chatty child never blocks on a full pipe."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        # From "<service> [<runtime id>] listening on <address>".
        self.runtime_id = ""
        self.address = ""
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, settings: Settings, *args: str, slots: int = 8) -> ServiceProcess:
        env = dict(os.environ)
        env.update(
            {
                "KEEL_DATABASE_URL": settings.database_url,
                "KEEL_PG_SCHEMA": settings.pg_schema,
                "KEEL_DATA_DIR": str(settings.data_dir),
                TOKEN_ENV: settings.internal_token,
                "KEEL_RUNNER_CONCURRENCY": str(slots),
                "KEEL_LOG_LEVEL": "WARNING",
                "PYTHONUNBUFFERED": "1",
            }
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "services.cli.main", *args),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        child = cls(process)
        try:
            await asyncio.wait_for(child._listening(), START_DEADLINE_S)
        except BaseException:
            await child.stop()
            raise
        child._reader = asyncio.create_task(child._read())
        return child

    async def _listening(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            words = line.split()
            if words[-3:-1] == ["listening", "on"]:
                self.address = words[-1]
                self.runtime_id = words[1] if len(words) == 5 else ""
                return
        raise RuntimeError("exited before it served:\n" + "\n".join(self.lines))

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 30)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 5)


async def _until(
    what: str, probe: Callable[[], Awaitable[bool]], deadline_s: float = WAIT_DEADLINE_S
) -> None:
    """Polls `probe` until it says True; fails a hung bench at the deadline."""
    deadline = time.monotonic() + deadline_s
    while not await probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _chain(steps: int, step_s: float) -> str:
    return "/tool " + " | ".join([f'sleep {{"seconds": {step_s}}}'] * steps)


def _figures(facts: dict[str, list[CommittedFact]], new: str, t0_ms: float) -> dict[str, Any]:
    """Reclaim times and handoff gaps, from the ledger's commit times."""
    reclaimed: list[float] = []
    gaps: list[float] = []
    for session_facts in facts.values():
        first = next(
            (
                (i, f)
                for i, f in enumerate(session_facts)
                if f.kind == "epoch_started" and f.data.get("runtimeId") == new
            ),
            None,
        )
        if first is None:
            continue
        index, start = first
        reclaimed.append(start.timestamp_ms - t0_ms)
        # A's facts carry its epochs; the last one before B's start.
        before = [f for f in session_facts[:index] if f.epoch and f.epoch < start.epoch]
        if before:
            gaps.append(start.timestamp_ms - before[-1].timestamp_ms)
    result: dict[str, Any] = {"handed_off": len(reclaimed)}
    if reclaimed:
        result.update(
            reclaimed_ms=round(max(reclaimed), 1),
            reclaimed_p50_ms=round(statistics.median(reclaimed), 1),
        )
    if gaps:
        result.update(
            handoff_gap_p50_ms=round(float(statistics.median(gaps)), 1),
            handoff_gap_p99_ms=round(float(percentile(gaps, 0.99)), 1),
            handoff_gap_max_ms=round(float(max(gaps)), 1),
        )
    return result


async def _drive(
    settings: Settings, ledger: LedgerClient, kernel: KernelClient, targets: tuple[str, str], *,
    sessions: int, steps: int, step_s: float,
) -> dict[str, Any]:  # fmt: skip
    names = [f"drain-{n}" for n in range(sessions)]
    for name in names:
        await ledger.create_session(name, TENANT)
        appended = await ledger.append_one(
            name, "input", {"text": _chain(steps, step_s), "requestId": "chain"}
        )
        await kernel.enqueue(name, TENANT, input_seq=appended.seq)
    runner_args = ("runner", "--ledger", targets[0], "--kernel", targets[1])
    runners: list[ServiceProcess] = []
    try:
        runners.append(old := await ServiceProcess.start(settings, *runner_args, slots=sessions))
        async with RunnerClient(old.address, settings) as old_client:

            async def all_held() -> bool:
                return (await old_client.status()).in_flight_runs == sessions

            await _until(f"runner A to hold all {sessions} sessions", all_held)
            runners.append(
                new := await ServiceProcess.start(settings, *runner_args, slots=sessions)
            )
            held = (await old_client.status()).in_flight_runs
            fences = {name: (await ledger.get_session(name)).fence_epoch for name in names}
            t0 = time.time()
            await old_client.drain("handoff", DRAIN_DEADLINE_MS)
            released_ms = (time.time() - t0) * 1000

        async def all_reclaimed() -> bool:
            # A successor's first fact raises the session's fence.
            for name, fence in list(fences.items()):
                if (await ledger.get_session(name)).fence_epoch > fence:
                    del fences[name]
            return not fences

        await _until("every session's successor to start", all_reclaimed)

        # The measured part is over: end the chains instead of waiting them out.
        async def cancel(name: str) -> None:
            await ledger.append_one(name, "cancelled", {"reason": "bench"})
            await kernel.enqueue(name, TENANT)

        await asyncio.gather(*(cancel(name) for name in names))

        async def settled() -> bool:
            views = [await ledger.get_session(name) for name in names]
            return not any(v.owed_input_seqs or v.open_tool_calls for v in views)

        await _until("every session to settle", settled)
        facts = {name: await ledger.read_all(name) for name in names}
    finally:
        for runner in reversed(runners):
            await runner.stop()
    violations: list[Violation] = [
        v
        for name, found in facts.items()
        for v in check_session(name, [fact_json(f) for f in found])
    ]
    return {
        "held_at_drain": held,
        "released_ms": round(released_ms, 1),
        **_figures(facts, new.runtime_id, t0 * 1000),
        "duplicates": duplicates(violations),
        "violations": len(violations),
        "violations_seen": [v.to_json() for v in violations[:5]],
    }


async def _run(url: str, sessions: int, steps: int, step_s: float) -> dict[str, Any]:
    settings = Settings(
        database_url=url,
        pg_schema=f"keel_bench_{uuid.uuid4().hex[:8]}",
        data_dir=Path(tempfile.mkdtemp(prefix="keel-bench-")),
        internal_token=secrets.token_urlsafe(32),
    )
    services: list[ServiceProcess] = []
    try:
        services.append(
            ledger := await ServiceProcess.start(settings, "ledger", "--address", _loopback())
        )
        services.append(
            kernel := await ServiceProcess.start(
                settings, "kernel", "--address", _loopback(), "--ledger", ledger.address
            )
        )
        async with (
            LedgerClient(ledger.address, settings) as ledger_client,
            KernelClient(kernel.address, settings) as kernel_client,
        ):
            await kernel_client.create_tenant(TENANT, "Bench tenant")
            await kernel_client.put_loadout(TENANT, {"admission": {"maxConcurrentRuns": sessions}})
            figures = await _drive(
                settings,
                ledger_client,
                kernel_client,
                (ledger.address, kernel.address),
                sessions=sessions,
                steps=steps,
                step_s=step_s,
            )
    finally:
        for service in reversed(services):
            await service.stop()
        _drop_schema(url, settings.pg_schema)
        shutil.rmtree(settings.data_dir, ignore_errors=True)
    return {
        "benchmark": "drain",
        "database": "postgresql",
        "sessions": sessions,
        "workload": f"one input per session: {steps} sleep tool calls of {step_s}s in a row",
        **figures,
        "targets": {"reclaimed_ms": 10_000, "duplicates": 0},
    }


def _loopback() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _drop_schema(url: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def measure(
    database_url: str | None = None, sessions: int = 100, steps: int = 60, step_s: float = 1.0
) -> dict[str, Any]:
    url = database_url or os.environ.get("KEEL_DATABASE_URL") or DEFAULT_URL
    return asyncio.run(_run(url, sessions, steps, step_s))
