"""Every service of `keel up --processes` SIGKILLed under load, on PostgreSQL.

Sessions are kept busy with inputs posted continuously, each with its own
request id and retried with the same id on a retryable failure (503,
502/504, or no HTTP answer at all). In turn, each service process is
SIGKILLed; the supervisor must start a new one (a new pid, ready again)
while the load goes on. Afterwards no request got anything but an
acknowledgement or a retryable failure (never a 500), every acknowledged
input is in the ledger once at the seq it was given and answered exactly
once (`keel chaos`'s rules over each whole session), and re-sending an
acknowledged input with its request id gets the same seq back. What each
new process prints shows in `keel up`'s output, prefixed with its name and pid.

With `--ledgers 2 --kernels 2` one ledger replica and one kernel replica
are killed while the other replica of each keeps serving. Two fast tests
pin what replicas rely on: one request id sent through two ledger
processes (one after the other, at once, and after one replica is gone,
through the comma-list target) is one input, since the dedup lives in the
database; and an Attach stream whose kernel replica goes away re-attaches
to the other one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from bench.input_load import InputLoad, LoadTally, settled_violations
from kernel import KernelClient, KernelServer
from services.common.config import Settings
from services.common.errors import ServiceUnavailable
from services.ledger import LedgerClient, LedgerServer
from tests.support.databases import drop_schema
from tests.support.keel_up import RunningKeel, child_pid, keel_up, restarted_child
from tests.support.polling import eventually

KEY = "service-kills-key-0123456789abcdef"
# Short leases: a session whose owner lost its kernel is retaken quickly
# even if a takeover has to wait for expiry.
LEASE_MS = 3000
SESSIONS = 4
# Inputs acknowledged before and after each kill: the load really flows
# through the dying service and through its replacement.
FLOWING = 4
# Without an HTTP answer or with a 503, nothing serves that path meanwhile.
NOTHING_ELSE_SERVES = ("ledger", "edge")


def _text(number: int) -> str:
    # A short stream: answers are often in flight when a service dies.
    return f"/slow 0.2 input {number}"


async def _flowing(tally: LoadTally, since: int, what: str) -> None:
    async def grown() -> bool | None:
        return True if len(tally.acknowledged) >= since + FLOWING else None

    await eventually(grown, what, 60)


async def _kill_under_load(up: RunningKeel, load: InputLoad, name: str) -> dict[str, Any]:
    tally = load.tally
    await _flowing(tally, len(tally.acknowledged), f"inputs acknowledged before {name} dies")
    failures_before = sum(tally.retryable.values())
    pid = child_pid(up, name)
    os.kill(pid, signal.SIGKILL)
    # The supervisor saw the SIGKILL itself (-9), not some other exit.
    await up.child.line(lambda line: f"{name} (pid {pid}) exited with -9; restarting" in line, 30)
    new_pid = await restarted_child(up, name, pid)
    assert new_pid != pid
    # What the new process printed is in `keel up`'s output, under its name.
    assert any(
        line.startswith(f"[{name} {new_pid}] ") and "listening on" in line
        for line in list(up.child.lines)
    ), up.child.output()
    await _flowing(tally, len(tally.acknowledged), f"inputs acknowledged after {name} is back")
    return {"name": name, "retryable": sum(tally.retryable.values()) - failures_before}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "victims"),
    [
        ((), ("ledger", "kernel", "compaction", "edge")),
        (("--ledgers", "2", "--kernels", "2"), ("ledger-1", "kernel-1")),
    ],
    ids=["one-of-each", "two-replicas"],
)
async def test_a_service_killed_under_load_is_restarted_and_nothing_acknowledged_is_lost(
    postgres_url: str, tmp_path: Path, flags: tuple[str, ...], victims: tuple[str, ...]
) -> None:
    schema = f"keel_t_{uuid.uuid4().hex[:12]}"
    env = {
        "KEEL_DATABASE_URL": postgres_url,
        "KEEL_PG_SCHEMA": schema,
        "KEEL_LEASE_MS": str(LEASE_MS),
    }
    kills: list[dict[str, Any]] = []
    try:
        with keel_up(tmp_path / "data", KEY, "--processes", *flags, env=env) as up:
            load = InputLoad(up.url, KEY, SESSIONS, pause_s=0.05, text=_text)
            try:
                await load.open()
                load.start()
                for victim in victims:
                    kills.append(await _kill_under_load(up, load, victim))
                await load.stop()
                violations, _ = await settled_violations(load, 60)
            finally:
                await load.close()
    finally:
        drop_schema(postgres_url, schema)
    tally = load.tally
    assert tally.unexpected == [], tally.unexpected
    assert violations == [], violations
    assert tally.redelivery_mismatches == [], tally.redelivery_mismatches
    assert tally.redeliveries > 0 and len(tally.acknowledged) >= FLOWING * 2 * len(victims)
    # While the only ledger or edge was gone, requests really failed, and
    # retryably (the tally only counts 502/503/504 and broken connections).
    for kill in kills:
        if kill["name"] in NOTHING_ELSE_SERVES:
            assert kill["retryable"] > 0, kills


async def test_one_request_id_through_two_ledger_replicas_is_one_input(
    pg_settings: Settings,
) -> None:
    first = await LedgerServer(pg_settings).start()
    second = await LedgerServer(pg_settings).start()
    replicas = f"{first.target},{second.target}"
    hello = {"text": "hello", "requestId": "r-1"}
    try:
        async with (
            LedgerClient(first.target, pg_settings) as via_first,
            LedgerClient(second.target, pg_settings) as via_second,
            LedgerClient(replicas, pg_settings) as via_list,
        ):
            await via_first.create_session("s-1", "default")
            # The second replica holds its own copy of the session, which
            # the first replica's append below makes stale.
            await via_second.append_one("s-1", "input", {"text": "first", "requestId": "r-0"})
            original = await via_first.append_one("s-1", "input", hello)
            again = await via_second.append_one("s-1", "input", hello)
            racing = await asyncio.gather(
                *(
                    client.append_one("s-1", "input", {"text": "race", "requestId": "r-2"})
                    for client in (via_first, via_second, via_first, via_second)
                )
            )
            await via_list.read("s-1")
            await first.stop()

            async def resent() -> object | None:
                # As a client does: a retryable failure is retried, same id.
                try:
                    return await via_list.append_one("s-1", "input", hello)
                except ServiceUnavailable:
                    return None

            after_failover = await eventually(resent, "an append through the live replica", 30)
            facts = await via_list.read_all("s-1")
    finally:
        await first.stop()
        await second.stop()
    assert not original.duplicate and again.duplicate and again.seq == original.seq
    assert sorted(r.duplicate for r in racing) == [False, True, True, True]
    assert len({r.seq for r in racing}) == 1
    assert after_failover == again
    inputs = [f.data["requestId"] for f in facts if f.kind == "input"]
    assert inputs == ["r-0", "r-1", "r-2"]


def _holds(kernel: KernelServer, runtime_id: str) -> bool:
    """`kernel` holds an Attach stream of `runtime_id` now."""
    return kernel.attachments is not None and kernel.attachments.attached(runtime_id)


async def test_an_attach_stream_reattaches_to_the_other_kernel_replica(
    pg_settings: Settings,
) -> None:
    first = await KernelServer(pg_settings).start()
    second = await KernelServer(pg_settings).start()
    try:
        async with KernelClient(f"{first.target},{second.target}", pg_settings) as kernel:
            await kernel.register_runtime("rt-1", pid=os.getpid())
            attachment = kernel.attach("rt-1")
            await attachment.wait_connected()
            holder, other = (second, first) if _holds(second, "rt-1") else (first, second)
            assert _holds(holder, "rt-1") and not _holds(other, "rt-1")
            await holder.stop(grace=0)

            async def reattached() -> bool | None:
                return True if _holds(other, "rt-1") else None

            await eventually(reattached, "the stream to re-attach to the live replica", 30)
            await attachment.wait_connected()
    finally:
        await first.stop()
        await second.stop()
