"""A stale owner that really races: its write arrives after its successor's.

Two real runner processes on one ledger and kernel (in this process). Each
round, whichever runner claims the round's session stops itself (SIGSTOP)
right before one of its writes: the assistant fact that makes the tool
calls, the first tool result, or the final answer. Its lease runs out, the
other runner takes over with epoch+1 and answers; then the stopped runner is
resumed, sends the write with the old epoch, and the ledger must refuse it
(STALE_EPOCH), as the ledger itself reports. The round fails if no stale
write reached the ledger. tests/support/stale_race.py has the round; the
order of the write points comes from a fixed seed. Many more rounds run in
`keel chaos --scenarios stale`.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.common.config import Settings
from services.runner.tool_state import counter_store
from tests.support.cluster import Cluster, running_cluster
from tests.support.stale_race import (
    CLAIM_WAIT_MS,
    WRITES,
    RaceRunner,
    StaleRace,
    Trigger,
    ledger_refusals,
    runtime_id,
)

pytestmark = pytest.mark.slow

LEASE_MS = 1000
ROUNDS = 20
SEED = 14


@pytest.fixture
async def cluster(pg_settings: Settings) -> AsyncIterator[Cluster]:
    async with running_cluster(pg_settings.with_overrides(lease_ms=LEASE_MS)) as running:
        yield running


def planned_points(seed: int, rounds: int) -> list[str]:
    """Every write point equally often, in an order the seed fixes."""
    points = [list(WRITES)[n % len(WRITES)] for n in range(rounds)]
    random.Random(seed).shuffle(points)
    return points


async def test_a_resumed_stale_owner_writes_and_the_ledger_refuses_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    trigger = Trigger(tmp_path / "fault-trigger")
    env = {**trigger.env(), "KEEL_CLAIM_WAIT_MS": CLAIM_WAIT_MS}
    processes = [cluster.start_runner(**env) for _ in range(2)]
    runners = [RaceRunner(p, await runtime_id(p)) for p in processes]
    counters = counter_store(cluster.settings)
    with ledger_refusals() as refusals:
        race = StaleRace(cluster.ledger, cluster.kernel, runners, trigger, refusals, counters)
        for number, point in enumerate(planned_points(SEED, ROUNDS)):
            await race.round(f"stale-{number}-{point}", point)
        # Nothing but the stale writes was refused, one per round.
        assert len(refusals()) == ROUNDS
