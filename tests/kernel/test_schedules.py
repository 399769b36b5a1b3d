"""Scheduled inputs: the rules (kernel.schedules), and the firing loop
(kernel.scheduler) against the real store and ledger, on a clock the test
moves (the kernel's own loop is slowed out of the way), and once on the real
clock through the kernel's own loop.

- a 1-minute cron over 3 minutes fires 3 times, each one input;
- missed firings (an outage of 10 minutes) fire once, late;
- a firing retried after a crash between the input and the schedule's
  advance is still one input (the request id is the schedule and due time);
- a one-off fires once and is gone; bad crons and zones are refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from kernel.errors import InvalidArgument
from kernel.schedule_store import ScheduleStore
from kernel.scheduler import Fire, Scheduler
from kernel.schedules import Schedule, after_firing, first_fire_ms, request_id
from services.common.config import Settings
from services.ledger.facts import INPUT
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.kernel_stores import FakeClock
from tests.support.polling import eventually

MINUTE_MS = 60_000
# 2026-12-02 06:00:10 UTC: ten seconds past a minute.
T0 = 1_796_191_210_000


@dataclass
class Firing:
    cluster: Cluster
    store: ScheduleStore
    clock: FakeClock
    fire: Fire
    scheduler: Scheduler

    async def inputs(self, session: str) -> list[str]:
        facts = await self.cluster.facts(session)
        return [str(f.data["requestId"]) for f in facts if f.kind == INPUT]


@pytest.fixture
async def firing(pg_settings: Settings) -> AsyncIterator[Firing]:
    # The kernel's own loop ticks once at start, then not for ten minutes.
    cluster = await start_cluster(pg_settings, schedule_tick_ms=600_000)
    try:
        assert cluster.kernel_server.database is not None
        clock = FakeClock(T0)
        store = ScheduleStore(cluster.kernel_server.database, clock)

        async def fire(schedule: Schedule, request: str) -> None:
            data = {"text": schedule.text, "requestId": request}
            appended = await cluster.ledger.append_one(schedule.session_id, INPUT, data)
            await cluster.kernel.enqueue(schedule.session_id, "default", input_seq=appended.seq)

        yield Firing(cluster, store, clock, fire, Scheduler(store, fire, 1_000, clock))
    finally:
        await stop_cluster(cluster)


async def test_a_minutely_cron_fires_once_a_minute_and_missed_ones_once(firing: Firing) -> None:
    await firing.cluster.new_session("minutely")
    schedule = firing.store.create("default", "minutely", "tick", "* * * * *", "UTC", 0)
    assert schedule.next_fire_ms == T0 - 10_000 + MINUTE_MS
    assert await firing.scheduler.tick() == 0
    for _ in range(3):
        firing.clock.advance(MINUTE_MS)
        assert await firing.scheduler.tick() == 1
        assert await firing.scheduler.tick() == 0  # nothing due twice
    assert len(await firing.inputs("minutely")) == 3

    # Ten minutes with the kernel away: one late firing, then on schedule.
    firing.clock.advance(10 * MINUTE_MS)
    assert await firing.scheduler.tick() == 1
    [after] = firing.store.of_session("minutely")
    assert firing.clock.now < after.next_fire_ms <= firing.clock.now + MINUTE_MS
    inputs = await firing.inputs("minutely")
    assert len(inputs) == 4 and len(set(inputs)) == 4


async def test_a_firing_retried_after_a_crash_is_one_input(firing: Firing) -> None:
    await firing.cluster.new_session("retried")
    schedule = firing.store.create("default", "retried", "once more", "*/5 * * * *", "UTC", 0)
    firing.clock.now = schedule.next_fire_ms

    class CrashingStore(ScheduleStore):
        def advance(self, fired: Schedule, next_fire_ms: int | None) -> bool:
            raise RuntimeError("the kernel died after the input, before the advance")

    assert firing.cluster.kernel_server.database is not None
    crashing = CrashingStore(firing.cluster.kernel_server.database, firing.clock)
    doomed = Scheduler(crashing, firing.fire, 1_000, firing.clock)
    with pytest.raises(RuntimeError):
        await doomed.tick()
    assert await firing.inputs("retried") == [request_id(schedule)]
    # The next tick (a restarted kernel, or another) fires the same time again.
    assert await firing.scheduler.tick() == 1
    assert await firing.inputs("retried") == [request_id(schedule)]


async def test_a_one_off_fires_once_and_is_gone(firing: Firing) -> None:
    await firing.cluster.new_session("once")
    firing.store.create("default", "once", "remind me", "", "UTC", T0 + 5_000)
    firing.clock.advance(5_000)
    assert await firing.scheduler.tick() == 1
    firing.clock.advance(MINUTE_MS)
    assert await firing.scheduler.tick() == 0
    assert firing.store.of_session("once") == []
    assert len(await firing.inputs("once")) == 1


async def test_the_kernels_own_loop_fires_on_the_real_clock(pg_settings: Settings) -> None:
    cluster = await start_cluster(pg_settings, schedule_tick_ms=50)
    try:
        await cluster.new_session("real")
        schedules = cluster.kernel_server.schedules
        assert schedules is not None
        due = schedules.create("default", "real", "now-ish", "", "UTC", 1)

        async def fired() -> list[str] | None:
            facts = await cluster.facts("real")
            inputs = [str(f.data["requestId"]) for f in facts if f.kind == INPUT]
            return inputs or None

        assert await eventually(fired, "the schedule to fire") == [request_id(due)]
        # Advanced (a one-off: gone) right after its input is in.
        await eventually(lambda: schedules.of_session("real") == [], "the one-off to be gone")
        assert len(await fired() or []) == 1
    finally:
        await stop_cluster(cluster)


def test_the_rules_refuse_what_cannot_be_a_schedule() -> None:
    with pytest.raises(InvalidArgument, match="cron"):
        first_fire_ms("every minute", "UTC", 0, T0)
    with pytest.raises(InvalidArgument, match="either"):
        first_fire_ms("* * * * *", "UTC", T0, T0)
    with pytest.raises(InvalidArgument, match="either"):
        first_fire_ms("", "UTC", 0, T0)
    with pytest.raises(InvalidArgument, match="time zone"):
        first_fire_ms("* * * * *", "Mars/Olympus", 0, T0)
    # 09:00 in Berlin is 08:00 UTC in December.
    nine = first_fire_ms("0 9 * * *", "Europe/Berlin", 0, T0)
    assert (nine - T0 + 10_000) % (24 * 3_600_000) == 2 * 3_600_000
    once = Schedule("s", "t", "x", "text", "", "UTC", T0, T0, T0)
    assert after_firing(once, T0) is None
