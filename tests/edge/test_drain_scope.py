"""A drain through the edge is scoped and can be undone (SPEC §3, §7).

- An unknown runtime id is an error (404, `keel drain` exits 1).
- No id: every attached runner of the deployment, never the edge (it keeps
  serving its streams, /readyz stays 200).
- A drain that has not finished can be undone, a runner's or this edge's.
- A runner listening on another address than 127.0.0.1 registers that
  address: the edge reaches it (status, deltas, drain) and so does its own
  embedded compaction service.
- `status` tells live, unreachable and gone runners apart.
- In a single-process `keel up`, a drained runner is replaced in process:
  new inputs are answered.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import httpx
import pytest

from services.runner.server import RunnerServer
from tests.support.edge_stack import ADMIN_KEY, Stack
from tests.support.keel_up import keel_cli, keel_up, run_keel
from tests.support.polling import eventually, eventually_sync
from tests.support.processes import ChildProcess
from tests.support.sse import SseReader, parse

OTHER_LOOPBACK = "127.0.0.2"
COMPACTING_LOADOUT = {
    "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": 2400},
    "compaction": {"enabled": True, "keepRecentTokens": 700, "reserveTokens": 600},
}


async def runtime_entry(stack: Stack, runtime_id: str) -> dict[str, Any]:
    report: dict[str, Any] = (await stack.http.get("/v1/runtime/status")).json()
    [entry] = [r for r in report["runtimes"] if r["runtimeId"] == runtime_id]
    found: dict[str, Any] = entry
    return found


def start_runner_process(stack: Stack, *args: str) -> ChildProcess:
    from tests.support.databases import settings_env

    cluster = stack.cluster
    return ChildProcess.python(
        "-m",
        "services.runner",
        "--ledger",
        cluster.ledger_server.target,
        "--kernel",
        cluster.kernel_server.target,
        *args,
        env=settings_env(cluster.settings),
    )


def listening(child: ChildProcess) -> tuple[str, str]:
    """(runtime id, address) from the runner's `listening on` line."""
    line = child.wait_for_line(lambda text: text.startswith("runner ") and "listening on" in text)
    words = line.split()
    return words[1], words[-1]


async def test_an_unknown_runtime_is_an_error_and_nothing_drains(
    stack: Stack, runner: RunnerServer
) -> None:
    for path in ("/v1/runtime/drain", "/v1/runtime/drain/undo"):
        refused = await stack.http.post(path, json={"runtimeId": "rt-nobody"})
        assert refused.status_code == 404, refused.text
        assert "rt-nobody" in refused.json()["error"]["message"]
    result = await keel_cli(
        "drain", "--runtime-id", "rt-nobody", "--url", stack.url, "--key", ADMIN_KEY
    )
    assert result.returncode == 1, result.stdout
    assert result.stderr.startswith("keel: no runtime 'rt-nobody' is registered"), result.stderr
    assert runner.runtime is not None and runner.runtime.claiming
    assert (await stack.http.get("/readyz")).status_code == 200


async def test_a_drain_without_an_id_drains_every_runner_and_not_the_edge(
    stack: Stack,
) -> None:
    first, second = await stack.start_runner(), await stack.start_runner()
    session = await stack.new_session()
    async with SseReader(stack.http, session) as sse:
        await sse.until(lambda e: e.event == "session_created")
        drained = await stack.http.post(
            "/v1/runtime/drain", json={"mode": "handoff", "deadlineMs": 5000}
        )
        assert drained.status_code == 202, drained.text
        body = drained.json()
        assert set(body["runtimes"]) == {first.runtime_id, second.runtime_id}
        assert body["edge"] is None and body["failed"] == {}
        for runner in (first, second):
            assert runner.runtime is not None and runner.runtime.finished.is_set()
        # The edge goes on: ready, its stream still open and served.
        assert (await stack.http.get("/readyz")).status_code == 200
        posted = await stack.post_input(session, "still here", "after-drain")
        assert posted.status_code == 202
        event = await sse.until(lambda e: e.id is not None and e.event == "input")
        assert parse(event)["seq"] == posted.json()["seq"]
    assert not stack.gateway.draining.is_set()


@pytest.mark.slow
async def test_unfinished_drains_are_undone_the_runner_claims_and_the_edge_serves(
    stack: Stack, runner: RunnerServer
) -> None:
    assert runner.runtime is not None
    session = await stack.new_session()
    sent = await stack.post_input(session, "/slow 8 one two three four five six", "r1")
    seq = sent.json()["seq"]

    async def running() -> bool | None:
        assert runner.runtime is not None
        return True if runner.runtime.in_flight else None

    await eventually(running, "the answer to start")
    draining = asyncio.create_task(
        stack.http.post(
            "/v1/runtime/drain",
            json={"runtimeId": runner.runtime_id, "deadlineMs": 120_000},
            timeout=150,
        )
    )

    async def runner_draining() -> bool | None:
        assert runner.runtime is not None
        return True if runner.runtime.drain_mode == "handoff" else None

    await eventually(runner_draining, "the runner to drain")
    # This edge drains too (as a rolling update would have it), unfinished.
    stack.gateway.start_draining("handoff")
    assert (await stack.http.get("/readyz")).status_code == 503
    undone = await stack.http.post("/v1/runtime/drain/undo", json={})
    assert undone.status_code == 200, undone.text
    assert sorted(undone.json()["undone"]) == sorted([runner.runtime_id, stack.gateway.edge_id])
    drained = await draining
    assert drained.status_code == 202 and drained.json()["undone"] == [runner.runtime_id]
    assert runner.runtime.claiming and not runner.runtime.finished.is_set()
    assert (await stack.http.get("/readyz")).status_code == 200
    entry = await runtime_entry(stack, runner.runtime_id)
    assert (entry["drainMode"], entry["claiming"], entry["liveness"]) == ("none", True, "live")

    # The stream is served again (no `drain`), and the same attempt answers.
    async with SseReader(stack.http, session) as sse:
        await sse.until(
            lambda e: e.event == "assistant" and seq in (parse(e)["data"].get("inputSeqs") or [])
        )
    facts = await stack.facts(session)
    assert [f.kind for f in facts].count("epoch_started") == 1
    assert await stack.cluster.kernel.list_handoffs() == []


@pytest.mark.slow
async def test_a_runner_on_another_address_is_reached_there(stack: Stack) -> None:
    child = start_runner_process(stack, "--address", f"{OTHER_LOOPBACK}:0")
    try:
        runtime_id, address = await asyncio.to_thread(listening, child)
        assert address.startswith(f"{OTHER_LOOPBACK}:")
        [registered] = [r for r in await stack.cluster.kernel.list_runtimes() if r.role == "runner"]
        assert registered.address == address
        entry = await runtime_entry(stack, runtime_id)
        assert (entry["liveness"], entry["claiming"]) == ("live", True)

        # Its partials reach the edge's clients.
        session = await stack.new_session()
        async with SseReader(stack.http, session) as sse:
            await stack.post_input(session, "/slow 2 one two three four", "r1")
            await sse.until(lambda e: e.event == "delta")
        await stack.cluster.settled(stack.ledger_id(session))
        # Its embedded compaction service is dialled where it listens.
        await stack.cluster.kernel.put_loadout("default", COMPACTING_LOADOUT)
        compacting = await stack.new_session()
        for turn in range(12):
            await stack.post_input(compacting, "/long 300", f"turn-{turn}")
            await stack.cluster.settled(stack.ledger_id(compacting))
            if any(f.kind == "compaction" for f in await stack.facts(compacting)):
                break
        assert any(f.kind == "compaction" for f in await stack.facts(compacting))

        drained = await stack.http.post("/v1/runtime/drain", json={"runtimeId": runtime_id})
        assert drained.status_code == 202, drained.text
        assert drained.json()["runtimes"] == {runtime_id: 0}
        assert await asyncio.to_thread(child.proc.wait, 30) == 0
    finally:
        child.kill()


async def test_a_wildcard_bind_advertises_an_address_or_refuses_to_start(stack: Stack) -> None:
    refused = start_runner_process(stack, "--address", "0.0.0.0:0")
    try:
        assert await asyncio.to_thread(refused.proc.wait, 30) == 2
        line = await refused.line(lambda text: text.startswith("keel runner:"))
    finally:
        refused.kill()
    assert line.startswith("keel runner: --address 0.0.0.0:0 listens on every interface")
    assert "--advertise-address" in line and "Traceback" not in refused.output()

    child = start_runner_process(
        stack, "--address", "0.0.0.0:0", "--advertise-address", OTHER_LOOPBACK
    )
    try:
        runtime_id, address = await asyncio.to_thread(listening, child)
        assert address.startswith(f"{OTHER_LOOPBACK}:")
        [registered] = [r for r in await stack.cluster.kernel.list_runtimes() if r.role == "runner"]
        assert (registered.runtime_id, registered.address) == (runtime_id, address)
    finally:
        child.kill()


@pytest.mark.slow
async def test_status_tells_live_unreachable_and_gone_runners_apart(stack: Stack) -> None:
    child = start_runner_process(stack)
    try:
        runtime_id, _ = await asyncio.to_thread(listening, child)
        assert (await runtime_entry(stack, runtime_id))["liveness"] == "live"
        # Hung: the kernel still holds its stream, but it answers nothing.
        os.kill(child.pid, signal.SIGSTOP)
        entry = await runtime_entry(stack, runtime_id)
        assert (entry["liveness"], entry["attached"], entry["claiming"]) == (
            "unreachable",
            True,
            False,
        )
        child.kill()

        async def gone() -> dict[str, Any] | None:
            entry = await runtime_entry(stack, runtime_id)
            return entry if entry["liveness"] == "gone" else None

        entry = await eventually(gone, "the kernel to see the runner gone", 30)
        assert not entry["attached"]
        shown = await keel_cli(
            "status", "--url", stack.url, "--key", ADMIN_KEY, env={"COLUMNS": "200"}
        )
        assert shown.returncode == 0, shown.stderr
        assert "liveness" in shown.stdout and "gone" in shown.stdout
        assert "no runner claims" in shown.stdout
    finally:
        child.kill()


@pytest.mark.slow
def test_in_a_single_process_keel_up_a_drained_runner_is_replaced(tmp_path: Any) -> None:
    key = "drain-scope-dev-key-0123456789"
    with keel_up(tmp_path / "data", key) as running:
        env = {"KEEL_DATA_DIR": str(running.data_dir), "KEEL_API_KEY": key}
        drained = run_keel("drain", "--deadline-ms", "5000", env=env)
        assert drained.returncode == 0, drained.stderr
        [line] = drained.stdout.splitlines()
        assert ": drained (handoff), 0 run(s) in flight" in line
        old_id = line.split(":")[0]
        replaced = running.child.wait_for_line(lambda text: "replaced by" in text)
        assert f"runner {old_id} drained; replaced by rt-" in replaced

        with httpx.Client(
            base_url=running.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as http:
            assert http.get("/readyz").status_code == 200
            session = http.post("/v1/sessions", json={}).json()["id"]
            seq = http.post(
                f"/v1/sessions/{session}/inputs", json={"text": "hello", "requestId": "r1"}
            ).json()["seq"]

            def answered() -> bool:
                page = http.get(f"/v1/sessions/{session}/events?format=json").json()
                return any(
                    f["kind"] == "assistant" and seq in f["data"].get("inputSeqs", [])
                    for f in page["facts"]
                )

            eventually_sync(answered, "the new input to be answered by the new runner")
