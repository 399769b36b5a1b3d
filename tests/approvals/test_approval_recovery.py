"""A call waiting for approval survives what happens to runners meanwhile.

While a call waits, nothing of Keel holds the session: no lease, no queue
entry, no slot, no attempt. So a runner SIGKILLed (while the session waits,
or at the commit boundary right after it asked), a handoff drain, and hours
passing in the kernel's time change nothing: when the decision comes, a
runner that was not there when it was asked runs the call exactly once
(counter effect 1, one execution, one tool_result).

Keel has no fake clock. Its only clock with consequences is the kernel's
(kernel.store.now_ms, read by the lease store and the runtime registry
through their `clock`): lease TTLs, backoff, retention. The "hours later"
test moves that clock six hours ahead of the wall clock (the runners renew
against it), runs the TTL sweep and the retention prune at that time, and
shows that neither finds anything of the waiting session, because there is
no lease and no timer to find; the ledger's own timestamps are records,
never deadlines.
"""

from __future__ import annotations

import asyncio

import pytest

from kernel import KernelClient
from services.runner.client import RunnerClient
from tests.support.approvals import (
    counter_store,
    holds_nothing,
    kinds,
    require_approval,
    shift_kernel_clock,
    until_answered,
    until_waiting,
)
from tests.support.edge_stack import Stack
from tests.support.polling import eventually

pytestmark = pytest.mark.slow

SIX_HOURS_MS = 6 * 3600 * 1000


async def ask(stack: Stack, key: str) -> tuple[str, int, str]:
    """Sends `/tool counter {key}`; (session id, input seq, waiting call id) once it waits."""
    session_id = await stack.new_session()
    posted = await stack.post_input(session_id, f'/tool counter {{"key": "{key}"}}', f"in-{key}")
    assert posted.status_code == 202, posted.text
    [pending] = (await until_waiting(stack.http, session_id))["pendingApprovals"]
    return session_id, int(posted.json()["seq"]), str(pending["toolCallId"])


async def approve(stack: Stack, session_id: str, call_id: str) -> None:
    response = await stack.http.post(
        f"/v1/sessions/{session_id}/approvals", json={"toolCallId": call_id, "approve": True}
    )
    assert response.status_code == 201, response.text


async def ran_once(stack: Stack, session_id: str, seq: int, key: str) -> None:
    facts = await until_answered(stack.cluster.ledger, stack.ledger_id(session_id), seq)
    assert len(kinds(facts, "approval_requested")) == 1
    [result] = kinds(facts, "tool_result")
    assert not result.data["isError"], result.data
    counter = counter_store(stack.cluster.settings)
    assert counter.value(key) == 1 and counter.executions(key) == 1
    seqs = [f.seq for f in facts]
    assert seqs == list(range(1, len(seqs) + 1))


async def detached(kernel: KernelClient, runtime_id: str) -> None:
    async def probe() -> bool | None:
        runtimes = {r.runtime_id: r for r in await kernel.list_runtimes()}
        gone = runtime_id not in runtimes or not runtimes[runtime_id].attached
        return True if gone else None

    await eventually(probe, f"the kernel to see {runtime_id} detached")


async def runtime_at(kernel: KernelClient, address: str) -> str:
    [runtime] = [r for r in await kernel.list_runtimes() if r.address == address]
    return runtime.runtime_id


async def test_the_runner_is_killed_and_replaced_while_a_call_waits(stack: Stack) -> None:
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    first = cluster.start_runner()
    first_id = await runtime_at(cluster.kernel, await cluster.runner_ready(first))
    session_id, seq, call_id = await ask(stack, "killed-while-waiting")
    await holds_nothing(cluster.kernel, stack.ledger_id(session_id))

    first.kill()
    await detached(cluster.kernel, first_id)
    # Nothing was held, so nothing was expired or handed over.
    await holds_nothing(cluster.kernel, stack.ledger_id(session_id))
    assert (await until_waiting(stack.http, session_id))["pendingApprovals"][0]["toolCallId"] == (
        call_id
    )

    successor = cluster.start_runner()
    await cluster.runner_ready(successor)
    await approve(stack, session_id, call_id)
    await ran_once(stack, session_id, seq, "killed-while-waiting")
    facts = await stack.facts(session_id)
    runtimes = {f.data["runtimeId"] for f in kinds(facts, "epoch_started")}
    assert first_id in runtimes and len(runtimes) == 2


async def test_a_kill_right_after_asking_leaves_one_request_and_one_run(stack: Stack) -> None:
    """SIGKILL at the commit boundary after `approval_requested`: the lease is
    held then; the successor takes over, finds only a waiting call (nothing
    owed, so it writes nothing, not even an epoch), and lets go."""
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    doomed = cluster.start_runner(KEEL_FAULT_POINT="after_approval_requested")
    await cluster.runner_ready(doomed)
    session_id = await stack.new_session()
    posted = await stack.post_input(session_id, '/tool counter {"key": "killed-at-ask"}', "in-1")
    await doomed.line(lambda line: line == "FAULT after_approval_requested", deadline_s=60)
    doomed.kill()

    successor = cluster.start_runner()
    await cluster.runner_ready(successor)
    [pending] = (await until_waiting(stack.http, session_id))["pendingApprovals"]
    await holds_nothing(cluster.kernel, stack.ledger_id(session_id))
    facts = await stack.facts(session_id)
    assert len(kinds(facts, "epoch_started")) == 1, "nothing was owed: no takeover epoch"

    await approve(stack, session_id, pending["toolCallId"])
    await ran_once(stack, session_id, int(posted.json()["seq"]), "killed-at-ask")


async def test_a_handoff_drain_while_a_call_waits_holds_nothing(stack: Stack) -> None:
    cluster = stack.cluster
    await require_approval(cluster.kernel)
    old = cluster.start_runner()
    address = await cluster.runner_ready(old)
    session_id, seq, call_id = await ask(stack, "drained-while-waiting")
    await holds_nothing(cluster.kernel, stack.ledger_id(session_id))

    async with RunnerClient(address, cluster.settings) as runner:
        outcome = await runner.drain_outcome("handoff", deadline_ms=60_000)
    # Nothing in flight when the drain began, nothing to stop, nothing to hand off.
    assert outcome.finished and outcome.in_flight_runs == 0 and outcome.stopped_runs == 0
    assert await asyncio.to_thread(old.proc.wait, 30) == 0
    handoffs = await cluster.kernel.list_handoffs()
    assert not [h for h in handoffs if h.session_id == stack.ledger_id(session_id)]
    await until_waiting(stack.http, session_id)

    await cluster.runner_ready(cluster.start_runner())
    await approve(stack, session_id, call_id)
    await ran_once(stack, session_id, seq, "drained-while-waiting")


async def test_the_decision_arrives_hours_later_in_the_kernels_time(stack: Stack) -> None:
    cluster = stack.cluster
    kernel_server = cluster.kernel_server
    assert kernel_server.leases is not None and kernel_server.registry is not None
    await require_approval(cluster.kernel)
    first = cluster.start_runner()
    first_id = await runtime_at(cluster.kernel, await cluster.runner_ready(first))
    session_id, seq, call_id = await ask(stack, "hours-later")
    ledger_id = stack.ledger_id(session_id)
    await holds_nothing(cluster.kernel, ledger_id)
    lease = await cluster.kernel.get_lease(ledger_id)
    assert lease.lease is None and not lease.queued and not lease.parked
    first.kill()
    await detached(cluster.kernel, first_id)

    # Six hours pass in the kernel's time: hundreds of lease TTLs, and the
    # retention of a runtime that went away.
    shift_kernel_clock(kernel_server, SIX_HOURS_MS)
    assert await asyncio.to_thread(kernel_server.leases.sweep) == 0
    retention = kernel_server.config.runtime_retention_ms
    assert retention < SIX_HOURS_MS
    assert await asyncio.to_thread(kernel_server.registry.prune, retention) >= 1
    assert first_id not in {r.runtime_id for r in await cluster.kernel.list_runtimes()}
    assert (await cluster.kernel.get_lease(ledger_id)).lease is None
    await until_waiting(stack.http, session_id)

    # A runner of the later hours takes the decision and runs the call once,
    # renewing its lease against the kernel's (later) time.
    await cluster.runner_ready(cluster.start_runner())
    await approve(stack, session_id, call_id)
    await ran_once(stack, session_id, seq, "hours-later")
    await holds_nothing(cluster.kernel, ledger_id)
