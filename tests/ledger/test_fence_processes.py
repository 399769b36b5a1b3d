"""The fence holds across ledger processes: a stale owner writing through
one ledger is refused after its successor committed through another.

Two ledger processes on one PostgreSQL schema and two runner processes,
each writing through its own ledger; the kernel (in this process) reads
through a third ledger. Whichever
runner claims a round's session stops itself right before a write; the
other takes over through the other ledger and answers; the stopped one is
resumed and its write, with the old epoch, reaches its own ledger, whose
copy of the session still holds the old fence (it has not seen the
successor's facts): only the database knows better. That ledger must
refuse it all the same, and says so in its log. The round is tests/support/stale_race.py's, as in
tests/runner/test_stale_owner_race.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernel import KernelClient, KernelServer
from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer
from services.runner.tool_state import counter_store
from tests.support.databases import settings_env
from tests.support.ports import free_port
from tests.support.processes import ChildProcess
from tests.support.stale_race import (
    CLAIM_WAIT_MS,
    WRITES,
    RaceRunner,
    Refusal,
    StaleRace,
    Trigger,
    refusals_in,
    runtime_id,
)

pytestmark = pytest.mark.slow

LEASE_MS = 1000
# Each write point, once with each runner likely to be the stale one.
ROUNDS = 2 * len(WRITES)


@pytest.fixture
def race_settings(pg_settings: Settings) -> Settings:
    return pg_settings.with_overrides(lease_ms=LEASE_MS)


@pytest.fixture
def ledger_targets() -> list[str]:
    # Named before the ledgers run, so the runners start alongside them.
    return [f"127.0.0.1:{free_port()}" for _ in range(2)]


@pytest.fixture
def ledgers(race_settings: Settings, ledger_targets: list[str]) -> Iterator[list[ChildProcess]]:
    env = settings_env(race_settings)
    children = [
        ChildProcess.python("-m", "services.ledger", "--address", target, env=env)
        for target in ledger_targets
    ]
    try:
        yield children
    finally:
        for child in children:
            child.kill()


async def test_a_stale_owner_is_refused_by_another_ledger_process(
    race_settings: Settings, ledgers: list[ChildProcess], ledger_targets: list[str], tmp_path: Path
) -> None:
    settings = race_settings
    # The kernel and this test read through a third ledger (in this process),
    # so neither runner's ledger refreshes its copy of a session by serving
    # their reads: the stale writer's ledger decides on a copy that still
    # holds the old fence, and only the database tells it otherwise.
    reader = await LedgerServer(settings).start()
    kernel_server = await KernelServer(settings, ledger_target=reader.target).start()
    trigger = Trigger(tmp_path / "fault-trigger")
    env = {**settings_env(settings), **trigger.env(), "KEEL_CLAIM_WAIT_MS": CLAIM_WAIT_MS}
    ledger = LedgerClient(reader.target, settings)
    kernel = KernelClient(kernel_server.target, settings)
    processes: list[ChildProcess] = []
    try:
        # Runner n writes through ledger n.
        processes += [
            ChildProcess.python(
                "-m",
                "services.runner",
                "--ledger",
                target,
                "--kernel",
                kernel_server.target,
                env=env,
            )
            for target in ledger_targets
        ]
        for child, target in zip(ledgers, ledger_targets, strict=True):
            assert await asyncio.to_thread(child.wait_listening) == target
        await kernel.create_tenant("default", "Default tenant")
        runners = [RaceRunner(p, await runtime_id(p)) for p in processes]

        def refusals() -> list[Refusal]:
            return [r for child in ledgers for r in refusals_in(child.lines)]

        counters = counter_store(settings)
        race = StaleRace(ledger, kernel, runners, trigger, refusals, counters)
        for number in range(ROUNDS):
            point = list(WRITES)[number % len(WRITES)]
            outcome = await race.round(f"two-ledgers-{number}-{point}", point)
            # Refused by the stale writer's own ledger, not the successor's.
            through = runners.index(outcome.stale)
            assert outcome.refusal in refusals_in(ledgers[through].lines)
            assert outcome.refusal not in refusals_in(ledgers[1 - through].lines)
        assert len(refusals()) == ROUNDS
    finally:
        for process in processes:
            process.kill()
        await ledger.close()
        await kernel.close()
        await kernel_server.stop()
        await reader.stop(grace=0.5)
