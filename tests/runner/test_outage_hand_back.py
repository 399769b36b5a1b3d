"""services.runner.outage: an attempt stopped by Keel's own outage hands its
lease back once the kernel answers again, instead of holding the session
until the lease's TTL; a lease already lost is not waited for."""

from __future__ import annotations

from kernel.errors import LeaseLost
from services.common.errors import DatabaseUnavailable, ServiceUnavailable
from services.runner.outage import once_answered


async def test_a_call_refused_during_an_outage_is_made_again_until_answered() -> None:
    answers: list[str] = []

    async def release() -> str:
        answers.append("asked")
        if len(answers) < 3:
            raise DatabaseUnavailable("kernel store unavailable")
        return "released"

    assert await once_answered(release, within_s=30) == "released"
    assert len(answers) == 3


async def test_a_lost_lease_is_not_waited_for() -> None:
    asked = 0

    async def release() -> None:
        nonlocal asked
        asked += 1
        raise LeaseLost("a successor holds it")

    assert await once_answered(release, within_s=30) is None
    assert asked == 1


async def test_the_wait_ends_with_the_lease() -> None:
    asked = 0

    async def release() -> None:
        nonlocal asked
        asked += 1
        raise ServiceUnavailable("the kernel is away")

    # Less than one backoff step left: asked once, then the TTL frees it.
    assert await once_answered(release, within_s=0.05) is None
    assert asked == 1
