"""Helpers for the approval tests (tests/approvals/): a loadout whose
`counter` needs a person's approval, and waits that poll with a deadline.

The stack is tests/edge/conftest.py's (in-process ledger, kernel, compaction
and edge, real gRPC and HTTP on loopback); runners are real OS processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import httpx

from agent_io.tools.builtin import CounterEffects
from kernel import KernelClient, KernelServer
from kernel.store import now_ms
from services.common.config import Settings
from services.ledger import CommittedFact, LedgerClient
from services.runner.tool_state import counter_store as deployment_counters
from tests.support.polling import eventually

T = TypeVar("T")

DEADLINE_S = 60.0
# `counter` waits for a person; `clock` does not.
APPROVAL_LOADOUT: dict[str, Any] = {
    "tools": [{"source": "builtin", "names": ["clock", "counter"], "requireApproval": ["counter"]}]
}


async def require_approval(kernel: KernelClient, tenant: str = "default") -> int:
    """Makes `counter` need an approval in `tenant`'s loadout; its revision."""
    return await kernel.put_loadout(tenant, APPROVAL_LOADOUT)


def counter_store(deployment: Settings | Path) -> CounterEffects:
    """The built-in counter's effects, as the runners of a deployment apply
    them: its settings, or the data dir of a `keel up` (SQLite)."""
    if isinstance(deployment, Settings):
        return deployment_counters(deployment)
    return deployment_counters(Settings(data_dir=deployment))


async def until_waiting(http: httpx.AsyncClient, session_id: str, count: int = 1) -> dict[str, Any]:
    """The session (GET /v1/sessions/{id}) once `count` calls wait for a
    decision and nothing runs."""

    async def probe() -> dict[str, Any] | None:
        response = await http.get(f"/v1/sessions/{session_id}")
        assert response.status_code == 200, response.text
        session: dict[str, Any] = response.json()
        waiting = session["status"] == "awaiting_approval"
        return session if waiting and len(session["pendingApprovals"]) == count else None

    return await eventually(probe, f"{session_id} to wait for {count} decision(s)")


async def until_answered(
    ledger: LedgerClient, ledger_id: str, input_seq: int
) -> list[CommittedFact]:
    """The session's facts once a final answer consumed `input_seq`."""

    async def probe() -> list[CommittedFact] | None:
        facts = await ledger.read_all(ledger_id)
        answered = any(
            f.kind == "assistant" and input_seq in (f.data.get("inputSeqs") or ()) for f in facts
        )
        return facts if answered else None

    return await eventually(probe, f"input {input_seq} of {ledger_id} to be answered")


async def holds_nothing(kernel: KernelClient, ledger_id: str) -> None:
    """Waits until the kernel holds no lease on the session and has not
    queued it (the attempt that asked has finished)."""

    async def probe() -> bool | None:
        info = await kernel.get_lease(ledger_id)
        return True if info.lease is None and not info.queued else None

    await eventually(probe, f"the kernel to hold nothing of {ledger_id}")


def kinds(facts: list[CommittedFact], kind: str) -> list[CommittedFact]:
    return [f for f in facts if f.kind == kind]


def shift_kernel_clock(kernel: KernelServer, offset_ms: int) -> None:
    """Moves an in-process kernel's clock `offset_ms` ahead of the wall clock.

    Keel has no clock of its own to fake: the kernel's stores read time
    through the `clock` they were built with (kernel.store.now_ms), which is
    what this replaces, for leases (TTLs, backoff, queue ages) and the
    runtime registry (retention). Runners renew against the kernel's time,
    so their leases stay consistent; nothing else in Keel keeps time."""
    assert kernel.leases is not None and kernel.registry is not None

    def shifted() -> int:
        return now_ms() + offset_ms

    # The stores' time seam (their `clock` argument), set after start-up.
    kernel.leases._clock = shifted
    kernel.registry._clock = shifted


async def claim_as_writer(kernel: KernelClient, writer: str) -> Any:
    """Registers `writer` as a runtime and claims the next queued session,
    as a runner would (for tests that commit a runner's facts themselves)."""
    await kernel.register_runtime(writer, host="test", pid=os.getpid(), role="runner")
    return await eventually(lambda: kernel.claim(writer, wait_ms=200), "a claim")
