"""The ledger is the fence: one writer per session, the newest epoch wins."""

from __future__ import annotations

import pytest

from services.ledger import (
    CommittedFact,
    FactToAppend,
    InvalidFact,
    LedgerClient,
    LedgerServer,
    StaleEpoch,
)
from tests.support.databases import settings_env
from tests.support.processes import ChildProcess


def started(epoch: int) -> dict[str, object]:
    return {"epoch": epoch, "runtimeId": "rt", "attemptId": f"a{epoch}", "watermark": 0}


def assert_single_writer(facts: list[CommittedFact]) -> None:
    """Every runner fact carries the epoch of the latest epoch_started before it."""
    fence = 0
    for fact in facts:
        if fact.kind == "epoch_started":
            assert fact.data["epoch"] > fence, f"fence went backwards at seq {fact.seq}"
            fence = fact.data["epoch"]
        elif fact.epoch != 0:
            assert fact.epoch == fence, (
                f"seq {fact.seq} written by epoch {fact.epoch} under {fence}"
            )


async def test_stale_epoch_is_rejected_and_changes_nothing(client: LedgerClient) -> None:
    await client.create_session("s", "t")
    await client.append_one("s", "epoch_started", started(1), epoch=1)
    await client.append_one("s", "assistant", {"generationId": "g1"}, epoch=1)
    await client.append_one("s", "epoch_started", started(2), epoch=2)
    head = (await client.get_session("s")).head_seq

    with pytest.raises(StaleEpoch) as caught:
        await client.append_one("s", "assistant", {"generationId": "g-old"}, epoch=1)
    assert caught.value.metadata == {"epoch": "1", "fence": "2"}
    with pytest.raises(StaleEpoch):
        await client.append_one("s", "epoch_started", started(2), epoch=2)
    with pytest.raises(StaleEpoch):
        await client.append_one("s", "epoch_started", started(1), epoch=1)
    # A request of several facts is all or nothing.
    with pytest.raises(StaleEpoch):
        await client.append(
            "s",
            [FactToAppend("assistant", {"generationId": "g-x"})],
            epoch=3,
        )

    view = await client.get_session("s")
    assert view.head_seq == head and view.fence_epoch == 2
    # Client inputs need no epoch and pass at any time.
    appended = await client.append_one("s", "input", {"text": "still here", "requestId": "r"})
    assert appended.seq == head + 1
    with pytest.raises(InvalidFact):
        await client.append_one("s", "assistant", {"generationId": "no-epoch"})
    assert_single_writer(await client.read_all("s"))


@pytest.mark.parametrize("settings", ["postgres"], indirect=True)
async def test_two_writer_processes_never_interleave_after_the_fence(
    ledger: LedgerServer, client: LedgerClient
) -> None:
    env = settings_env(ledger.settings)
    for round_no in range(3):
        session_id = f"race-{round_no}"
        await client.create_session(session_id, "t")
        writers = [
            ChildProcess.python(
                "-m",
                "tests.ledger.fenced_writer",
                ledger.target,
                session_id,
                str(epoch),
                "150",
                env=env,
            )
            for epoch in (2 * round_no + 1, 2 * round_no + 2)
        ]
        try:
            for writer in writers:
                await writer.line(lambda line: line == "ready")
            for writer in writers:
                writer.send_line("go")
            outcomes = [
                await w.line(lambda line: line.startswith(("fenced", "done"))) for w in writers
            ]
        finally:
            for writer in writers:
                writer.kill()
        facts = await client.read_all(session_id)
        assert_single_writer(facts)
        newest = 2 * round_no + 2
        last_start = max(f.seq for f in facts if f.kind == "epoch_started")
        after = [f for f in facts if f.seq > last_start]
        assert {f.epoch for f in after} <= {newest}
        # The newer writer always finishes; the older one may be fenced off.
        assert outcomes[1] == "done 150"
