"""Operator endpoints: drain a runtime, and report every runtime's state."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

from edge.gateway import Gateway
from services.common.errors import KeelError


async def drain_runners(
    gateway: Gateway, mode: str, deadline_ms: int, runtime_id: str | None
) -> dict[str, Any]:
    targets = [runtime_id] if runtime_id else list(gateway.local_runtime_ids)
    drained: dict[str, int] = {}

    async def one(target: str) -> None:
        runner = await gateway.runner(target)
        if runner is None:
            return
        with contextlib.suppress(KeelError):
            drained[target] = await runner.drain(mode, deadline_ms)

    # Runners stop claiming at once; handoff waits for commit boundaries.
    drain_all = asyncio.gather(*(one(t) for t in targets))
    if runtime_id is None:
        # This whole runtime drains: its SSE clients are told to reconnect
        # (elsewhere, or here after a restart); inputs are still accepted.
        gateway.start_draining(mode)
    await drain_all
    return {
        "mode": mode,
        "runtimes": drained,
        "edge": gateway.edge_id if runtime_id is None else None,
    }


async def report(gateway: Gateway) -> dict[str, Any]:
    runtimes = await gateway.runtimes()

    async def describe(info: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "runtimeId": info.runtime_id,
            "role": info.role,
            "host": info.host,
            "pid": info.pid,
            "address": info.address,
            "drainMode": info.drain_mode,
            "attached": info.attached,
            "claiming": False,
            "inFlightRuns": len(info.session_ids),
            "sessionIds": list(info.session_ids),
            "loadoutRevision": info.loadout_revision,
        }
        runner = await gateway.runner(info.runtime_id) if info.attached else None
        if runner is not None:
            with contextlib.suppress(KeelError, TimeoutError):
                status = await asyncio.wait_for(runner.status(), 2)
                entry["claiming"] = status.claiming
                entry["inFlightRuns"] = status.in_flight_runs
                entry["drainMode"] = status.drain_mode
        return entry

    entries = await asyncio.gather(*(describe(r) for r in runtimes if r.role == "runner"))
    edge = {
        "runtimeId": gateway.edge_id,
        "role": "edge",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "drainMode": gateway.drain_mode,
        "claiming": False,
        "inFlightRuns": 0,
        "sessionIds": [],
    }
    return {"runtimes": [*entries, edge]}
