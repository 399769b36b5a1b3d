"""A firing with its kernel SIGKILLed around the fire time happens once.

A kernel process freezes right after a due schedule's input is committed,
before the schedule is advanced (KEEL_FAULT_POINT=after_schedule_fire), and
is SIGKILLed there. Another kernel process on the same database finds the
schedule still due, fires it again, and the ledger keeps one input: the
firing's request id is the schedule and the time it was due.
"""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator

import pytest

from kernel.database import Database
from kernel.schedule_store import ScheduleStore
from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer
from services.ledger.facts import INPUT
from tests.support.cluster import running_ledger
from tests.support.databases import settings_env
from tests.support.polling import eventually
from tests.support.ports import free_port
from tests.support.processes import ChildProcess

pytestmark = pytest.mark.slow

DEADLINE_S = 60.0


@pytest.fixture
async def ledger(pg_settings: Settings) -> AsyncIterator[LedgerServer]:
    async with running_ledger(pg_settings) as server:
        yield server


def _kernel(settings: Settings, ledger: str, **env: str) -> ChildProcess:
    child_env = settings_env(settings)
    child_env.update(env)
    address = f"127.0.0.1:{free_port()}"
    return ChildProcess.python(
        "-m",
        "services.cli.main",
        "kernel",
        "--address",
        address,
        "--ledger",
        ledger,
        env=child_env,
    )


async def test_a_firing_is_one_input_when_its_kernel_dies_mid_firing(
    pg_settings: Settings, ledger: LedgerServer
) -> None:
    async with LedgerClient(ledger.target, pg_settings) as client:
        await client.create_session("timed", "default")
        database = Database(pg_settings)
        try:
            store = ScheduleStore(database)
            due = store.create("default", "timed", "it is time", "", "UTC", int(time.time() * 1000))
        finally:
            database.close()

        doomed = _kernel(pg_settings, ledger.target, KEEL_FAULT_POINT="after_schedule_fire")
        try:
            await doomed.line(lambda line: line == "FAULT after_schedule_fire", DEADLINE_S)
        finally:
            doomed.kill()
        assert doomed.proc.returncode == -signal.SIGKILL, doomed.output()

        async def inputs() -> list[str]:
            facts = await client.read_all("timed")
            return [str(f.data["requestId"]) for f in facts if f.kind == INPUT]

        assert await inputs() == [f"schedule-{due.schedule_id}-{due.next_fire_ms}"]

        successor = _kernel(pg_settings, ledger.target)
        try:
            database = Database(pg_settings)
            try:
                store = ScheduleStore(database)
                await eventually(
                    lambda: store.of_session("timed") == [], "the successor to fire it again"
                )
            finally:
                database.close()
        finally:
            successor.kill()
        assert await inputs() == [f"schedule-{due.schedule_id}-{due.next_fire_ms}"]
