"""Scheduled inputs over HTTP and gRPC, with a real runner: a one-off fires
once and is answered, a cron schedule is listed until it is deleted, and
what cannot be a schedule is refused with the field named."""

from __future__ import annotations

import time

import pytest

from services.ledger.facts import ASSISTANT, INPUT
from services.runner.server import RunnerServer
from tests.support.edge_stack import Stack
from tests.support.front_doors import FrontDoor, Refused
from tests.support.polling import eventually


async def test_a_one_off_fires_once_and_is_answered(
    stack: Stack, runner: RunnerServer, door: FrontDoor
) -> None:
    session = await door.create_session()
    soon = int(time.time() * 1000) + 500
    schedule_id = await door.schedule(session, "the scheduled question", at_ms=soon)

    async def answered() -> int | None:
        facts = await stack.facts(session)
        inputs = [f for f in facts if f.kind == INPUT]
        answers = [f for f in facts if f.kind == ASSISTANT and f.data.get("inputSeqs")]
        return len(inputs) if inputs and answers else None

    assert await eventually(answered, "the scheduled input to be answered") == 1
    [fired] = [f for f in await stack.facts(session) if f.kind == INPUT]
    assert fired.data["text"] == "the scheduled question"
    assert fired.data["requestId"] == f"schedule-{schedule_id}-{soon}"

    async def gone() -> bool:
        return await door.schedules(session) == []

    await eventually(gone, "the one-off to be gone once fired")


async def test_a_cron_schedule_is_listed_until_deleted(stack: Stack, door: FrontDoor) -> None:
    session = await door.create_session()
    weekly = await door.schedule(session, "weekly", cron="0 9 * * 1", timezone="Europe/Berlin")
    assert await door.schedules(session) == [weekly]
    await door.unschedule(session, weekly)
    assert await door.schedules(session) == []
    with pytest.raises(Refused) as gone:
        await door.unschedule(session, weekly)
    assert gone.value.outcome == "not_found"


@pytest.mark.parametrize(
    ("cron", "timezone"),
    [("every monday", "UTC"), ("0 9 * * 1", "Mars/Olympus"), ("* * *", "UTC")],
)
async def test_what_cannot_be_a_schedule_is_refused(
    stack: Stack, door: FrontDoor, cron: str, timezone: str
) -> None:
    session = await door.create_session()
    with pytest.raises(Refused) as refused:
        await door.schedule(session, "x", cron=cron, timezone=timezone)
    assert refused.value.outcome == "invalid_argument"
    assert await door.schedules(session) == []
