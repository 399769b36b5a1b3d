"""`keel drain --local`: drain the runtimes of this pod or host, directly.

Kubernetes runs it as the `preStop` of runner and edge pods: it finds the
processes that recorded themselves under the data dir (runners and edges,
services/common/runtime_records.py) and drains each where it runs — a
runner over its internal gRPC Drain, an edge through its local drain
endpoint (loopback only, internal token) — without the edge's public API,
an operator key, or the kernel. It exits 0 once every runtime found has
finished its drain (a runner's attempts stopped and leases given back, an
edge's streams gone or its deadline passed), and 1 with a line per failure
otherwise. `--undo` undoes drains that have not finished.

A record whose process is gone (SIGKILLed, so it could not remove it) is
deleted; one whose pid was reused is told apart by the runtime id the
answering process reports, and skipped.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.cli.data_dir import TOKEN_FILE, data_dir_token
from services.cli.discovery import read_discovery
from services.common.config import Settings
from services.common.errors import KeelError
from services.common.internal_auth import TOKEN_HEADER
from services.common.runtime_records import LOCAL_DRAIN_PATH, RuntimeRecord, live_runtimes
from services.runner.client import RunnerClient
from services.runner.errors import InvalidDrain

# A drain answers by its deadline; this much more is its reply's way back.
REPLY_GRACE_S = 10.0


class StaleRecord(Exception):
    """Another process answers where the record points: not that runtime."""


@dataclass(frozen=True)
class LocalDrain:
    mode: str
    deadline_ms: int
    data_dir: Path
    undo: bool = False
    # Only this runtime of the host (None: every one recorded).
    runtime_id: str | None = None


def local_settings(settings: Settings) -> Settings:
    """`settings` with the internal token: the environment's, else the one
    `keel up` keeps in the data dir (read, never made here)."""
    if settings.internal_token:
        return settings
    if (Path(settings.data_dir) / TOKEN_FILE).is_file():
        return settings.with_overrides(internal_token=data_dir_token(Path(settings.data_dir)))
    return settings


def beside_keel_up(data_dir: Path) -> bool:
    """Whether a `keel up` runs on `data_dir` (its announcement names a live pid)."""
    record = read_discovery(data_dir) or {}
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recorded(request: LocalDrain) -> list[RuntimeRecord]:
    """The live runtimes to drain (records of processes that are gone are
    deleted on the way, without a word)."""
    records = live_runtimes(request.data_dir)
    if request.runtime_id is not None:
        return [r for r in records if r.runtime_id == request.runtime_id]
    if beside_keel_up(request.data_dir):
        return [r for r in records if r.role == "runner"]
    return records


async def _runner(record: RuntimeRecord, request: LocalDrain, settings: Settings) -> str:
    mode = "none" if request.undo else request.mode
    async with RunnerClient(record.address, settings) as client:
        try:
            outcome = await asyncio.wait_for(
                client.drain_outcome(mode, request.deadline_ms, runtime_id=record.runtime_id),
                request.deadline_ms / 1000 + REPLY_GRACE_S,
            )
        except InvalidDrain as error:
            if error.metadata.get("runtime_id"):
                raise StaleRecord(error.message) from None
            raise
    if request.undo:
        if outcome.finished:
            raise RuntimeError("its drain has finished: it exits and is replaced")
        return "drain undone" if outcome.undone else "was not draining"
    return (
        f"drained ({request.mode}): {outcome.in_flight_runs} run(s) in flight, "
        f"{outcome.stopped_runs} stopped where they were"
    )


async def _edge(record: RuntimeRecord, request: LocalDrain, settings: Settings) -> str:
    if not settings.internal_token:
        raise RuntimeError(
            "no internal token: set KEEL_INTERNAL_TOKEN (the edge's) to drain it locally"
        )
    body: dict[str, object] = {"runtimeId": record.runtime_id}
    if request.undo:
        body["undo"] = True
    else:
        body.update(mode=request.mode, deadlineMs=request.deadline_ms)
    async with httpx.AsyncClient(timeout=request.deadline_ms / 1000 + REPLY_GRACE_S) as http:
        response = await http.post(
            f"http://{record.address}{LOCAL_DRAIN_PATH}",
            json=body,
            headers={TOKEN_HEADER: settings.internal_token},
        )
    if response.status_code == 409 and "this is edge" in response.text:
        raise StaleRecord(response.text)
    if response.is_error:
        raise RuntimeError(f"refused (HTTP {response.status_code}): {response.text.strip()}")
    answer = response.json()
    if request.undo:
        return "drain undone" if answer.get("undone") else "was not draining"
    return f"drained: {answer.get('openStreams', 0)} stream(s) still open at the end"


async def drain_local(request: LocalDrain, settings: Settings) -> tuple[list[str], list[str]]:
    """Drains (or undoes) every recorded runtime at once; (lines, failures)."""
    records = recorded(request)
    lines: list[str] = []
    failures: list[str] = []
    if not records:
        what = f"runtime {request.runtime_id}" if request.runtime_id else "no runtime"
        failures.append(
            f"{what} recorded under {request.data_dir / 'runtimes'}: nothing to drain "
            "(is --data-dir, or KEEL_DATA_DIR, the runtime's?)"
            if not request.runtime_id
            else f"{what} is not recorded (alive) under {request.data_dir / 'runtimes'}"
        )
        return lines, failures

    async def one(record: RuntimeRecord) -> None:
        name = f"{record.role} {record.runtime_id} (pid {record.pid})"
        drain = _runner if record.role == "runner" else _edge
        try:
            lines.append(f"{name}: {await drain(record, request, settings)}")
        except StaleRecord:
            lines.append(f"{name}: another process answers at {record.address}; skipped")
        except TimeoutError:
            failures.append(f"{name}: no answer at {record.address} within the deadline")
        except (KeelError, httpx.HTTPError, RuntimeError, OSError) as error:
            failures.append(f"{name} at {record.address}: {error or type(error).__name__}")

    await asyncio.gather(*(one(r) for r in records))
    return lines, failures
