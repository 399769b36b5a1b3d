"""Runtime endpoints: drain a runtime (operators), and report every runtime's
state (operators see everything, a tenant's admin its own sessions)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

from edge.auth import Caller
from edge.gateway import Gateway
from kernel import RuntimeInfo
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


def _held_sessions(info: RuntimeInfo, caller: Caller) -> list[dict[str, str]]:
    """The sessions a runtime holds that the caller may see, by the ids
    clients use: a tenant's admin its own tenant's, an operator every
    tenant's, each with its tenant (two tenants may both have an `s-1`)."""
    tenants = info.session_tenant_ids or ("",) * len(info.session_ids)
    sessions: list[dict[str, str]] = []
    for ledger_id, tenant in zip(info.session_ids, tenants, strict=True):
        if not caller.operator and tenant != caller.tenant_id:
            continue
        # The edge names a tenant's session `<tenant>:<id>`; a session made
        # outside the edge keeps the ledger's id.
        prefix = f"{tenant}:"
        public = ledger_id[len(prefix) :] if ledger_id.startswith(prefix) else ledger_id
        sessions.append({"id": public, "tenant": tenant} if caller.operator else {"id": public})
    return sessions


async def report(gateway: Gateway, caller: Caller) -> dict[str, Any]:
    """Every runtime's state. Where runtimes run (host, pid, address) is the
    operator's business; a tenant's admin sees the runtimes' ids and states
    and its own sessions only."""
    runtimes = await gateway.runtimes()

    async def describe(info: RuntimeInfo) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "runtimeId": info.runtime_id,
            "role": info.role,
            "drainMode": info.drain_mode,
            "attached": info.attached,
            "claiming": False,
            "inFlightRuns": len(info.session_ids),
            "loadoutRevision": info.loadout_revision,
            "sessions": _held_sessions(info, caller),
        }
        if caller.operator:
            entry.update(host=info.host, pid=info.pid, address=info.address)
        runner = await gateway.runner(info.runtime_id) if info.attached else None
        if runner is not None:
            with contextlib.suppress(KeelError, TimeoutError):
                status = await asyncio.wait_for(runner.status(), 2)
                entry["claiming"] = status.claiming
                entry["inFlightRuns"] = status.in_flight_runs
                entry["drainMode"] = status.drain_mode
        return entry

    entries = await asyncio.gather(*(describe(r) for r in runtimes if r.role == "runner"))
    edge: dict[str, Any] = {
        "runtimeId": gateway.edge_id,
        "role": "edge",
        "drainMode": gateway.drain_mode,
        "claiming": False,
        "inFlightRuns": 0,
        "sessions": [],
    }
    if caller.operator:
        edge.update(host=socket.gethostname(), pid=os.getpid())
    return {"runtimes": [*entries, edge]}
