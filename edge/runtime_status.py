"""What `GET /v1/runtime/status` reports, and this edge's own entry in the
kernel's registry.

Every runtime is listed: each runner and each edge the kernel knows of,
whichever kernel (of the deployment's several) holds its Attach stream. An
edge registers and attaches like a runner does (`attach_edge`), so an edge
asked on one node lists the edges of every node.

`liveness` is what the answering edge found:

- `live`: a runner answered this edge; an edge is this one, or the kernel
  this edge asks holds its stream;
- `attached to another kernel`: it does not answer here, but another
  kernel holds its stream and beats for it (a runner on another node,
  listening where only its node dials): alive, not lost;
- `unreachable`: this edge's own kernel holds its stream, yet it does not
  answer at its address;
- `gone`: no kernel holds its stream (or its heartbeat is stale).

A tenant's admin sees every runtime's id and state but only its own
tenant's sessions, and counts only its own runs in flight; where runtimes
run (host, pid, address) and other tenants' work are the operator's.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from edge.auth import Caller
from edge.gateway import Gateway
from kernel import RuntimeInfo
from kernel.client import Attachment
from services.common.errors import KeelError

# How long the status report waits for each runner's own state.
STATUS_TIMEOUT_S = 2.0

LIVE = "live"
ELSEWHERE = "attached to another kernel"
UNREACHABLE = "unreachable"
GONE = "gone"
LIVENESS = (LIVE, ELSEWHERE, UNREACHABLE, GONE)


def attach_edge(gateway: Gateway, address: str) -> Attachment:
    """Registers this edge with the kernel and holds its Attach stream for
    as long as the gateway's kernel client is open, as a runner does: the
    kernel beats for it and every edge lists it. Nothing waits for it: the
    first Attach of an edge not yet registered registers it, and so does one
    after the kernel forgot it; a kernel that is away is retried."""

    async def register() -> None:
        await gateway.kernel.register_runtime(
            gateway.edge_id, address, host=socket.gethostname(), pid=os.getpid(), role="edge"
        )

    return gateway.kernel.attach(gateway.edge_id, reregister=register)


async def services_answer(gateway: Gateway) -> bool:
    """Whether the kernel and the ledger both answer this edge, each through
    a call that reaches its database (what /readyz asks): the probe that
    tells an edge's refusals are over (edge.refusals)."""
    try:
        await asyncio.wait_for(
            asyncio.gather(gateway.kernel.list_runtimes(), gateway.ledger.list_sessions(limit=1)),
            STATUS_TIMEOUT_S,
        )
    except (KeelError, TimeoutError):
        return False
    return True


def _tenants_of(info: RuntimeInfo) -> dict[str, str]:
    """The tenant of each session the kernel says `info` holds, by ledger id."""
    tenants = info.session_tenant_ids or ("",) * len(info.session_ids)
    return dict(zip(info.session_ids, tenants, strict=True))


def _visible(ledger_id: str, tenants: dict[str, str], caller: Caller) -> bool:
    """Whether the caller may see (or count) a session of a runtime: an
    operator every one, a tenant's admin its own tenant's. A session the
    runner runs but the kernel's list missed (claimed between the two
    reads) is known by the `<tenant>:` prefix the edge gives its ids."""
    if caller.operator:
        return True
    tenant = tenants.get(ledger_id)
    if tenant is None:
        return ledger_id.startswith(f"{caller.tenant_id}:")
    return tenant == caller.tenant_id


def _held_sessions(info: RuntimeInfo, caller: Caller) -> list[dict[str, str]]:
    """The sessions a runtime holds that the caller may see, by the ids
    clients use: a tenant's admin its own tenant's, an operator every
    tenant's, each with its tenant (two tenants may both have an `s-1`)."""
    tenants = _tenants_of(info)
    sessions: list[dict[str, str]] = []
    for ledger_id, tenant in tenants.items():
        if not _visible(ledger_id, tenants, caller):
            continue
        # The edge names a tenant's session `<tenant>:<id>`; a session made
        # outside the edge keeps the ledger's id.
        prefix = f"{tenant}:"
        public = ledger_id[len(prefix) :] if ledger_id.startswith(prefix) else ledger_id
        sessions.append({"id": public, "tenant": tenant} if caller.operator else {"id": public})
    return sessions


def _not_answering(info: RuntimeInfo) -> str:
    """The liveness of a runtime that did not answer this edge."""
    if not info.attached:
        return GONE
    return UNREACHABLE if info.attached_here else ELSEWHERE


def _entry(info: RuntimeInfo, caller: Caller) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "runtimeId": info.runtime_id,
        "role": info.role,
        "liveness": _not_answering(info),
        "drainMode": info.drain_mode,
        "attached": info.attached,
        "claiming": False,
        "inFlightRuns": len(_held_sessions(info, caller)),
        "loadoutRevision": info.loadout_revision,
        "sessions": _held_sessions(info, caller),
    }
    if caller.operator:
        entry.update(host=info.host, pid=info.pid, address=info.address)
    return entry


async def _describe_runner(gateway: Gateway, info: RuntimeInfo, caller: Caller) -> dict[str, Any]:
    entry = _entry(info, caller)
    if not info.attached:
        return entry
    runner = await gateway.runner(info.runtime_id)
    if runner is None:
        return entry
    try:
        status = await asyncio.wait_for(runner.status(), STATUS_TIMEOUT_S)
    except (KeelError, TimeoutError):
        return entry
    tenants = _tenants_of(info)
    entry["liveness"] = LIVE
    entry["claiming"] = status.claiming
    entry["inFlightRuns"] = sum(1 for s in status.session_ids if _visible(s, tenants, caller))
    entry["drainMode"] = status.drain_mode
    return entry


def _this_edge(gateway: Gateway, registered: RuntimeInfo | None, caller: Caller) -> dict[str, Any]:
    edge: dict[str, Any] = {
        "runtimeId": gateway.edge_id,
        "role": "edge",
        "liveness": LIVE,
        "drainMode": gateway.drain_mode,
        "attached": registered is not None and registered.attached,
        "claiming": False,
        "inFlightRuns": 0,
        "sessions": [],
    }
    if caller.operator:
        edge.update(host=socket.gethostname(), pid=os.getpid())
        if registered is not None:
            edge["address"] = registered.address
    return edge


def _other_edge(info: RuntimeInfo, caller: Caller) -> dict[str, Any]:
    entry = _entry(info, caller)
    if info.attached and info.attached_here:
        # Its stream is held by the kernel this edge asks: it is alive.
        entry["liveness"] = LIVE
    return entry


async def report(gateway: Gateway, caller: Caller) -> dict[str, Any]:
    """Every runtime's state: runners first, then this edge, then the
    other edges."""
    runtimes = await gateway.runtimes()
    runners = await asyncio.gather(
        *(_describe_runner(gateway, r, caller) for r in runtimes if r.role == "runner")
    )
    edges = [r for r in runtimes if r.role == "edge"]
    this = next((r for r in edges if r.runtime_id == gateway.edge_id), None)
    others = [_other_edge(r, caller) for r in edges if r.runtime_id != gateway.edge_id]
    return {
        "runtimes": [*runners, _this_edge(gateway, this, caller), *others],
        # Zero: inputs are accepted and wait until a runner claims again.
        "claimingRunners": sum(1 for e in runners if e["claiming"]),
    }
