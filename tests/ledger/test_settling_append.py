"""An append that carries its attempt's Finish, over real gRPC.

On PostgreSQL, with the kernel's tables in the ledger's database, the
answer's append settles the lease in its own transaction: the reply says
until when the session is kept, and the kernel's row says the same. Where
the ledger cannot settle (SQLite, a duplicate append, an input that came
after the answer's watermark), the reply says 0 and the lease is untouched,
for the runner's Finish. A refused append settles nothing, and a settlement
that cannot be a runner's is refused with its own reason.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from kernel import Lease
from kernel.domain import LeaseState, SessionRecord
from services.common.config import Settings
from services.ledger import InvalidId, InvalidSettlement, LedgerError, Settlement, StaleEpoch
from services.ledger.facts import ASSISTANT, EPOCH_STARTED
from tests.support.cluster import Cluster, running_cluster

STICKY_MS = 30_000


@pytest.fixture
async def cluster(settings: Settings) -> AsyncIterator[Cluster]:
    async with running_cluster(settings) as started:
        yield started


async def _held(cluster: Cluster, runtime_id: str) -> tuple[Lease, int]:
    """A session with one input, claimed by `runtime_id`, its fence raised;
    the lease and the input's seq."""
    session_id = f"s-{uuid.uuid4().hex[:8]}"
    await cluster.kernel.register_runtime(runtime_id)
    await cluster.new_session(session_id)
    seq = await cluster.send(session_id, "hello", "r1")
    lease = await cluster.kernel.claim(runtime_id, wait_ms=5_000)
    assert lease is not None and lease.session_id == session_id
    data = {"epoch": lease.epoch, "runtimeId": runtime_id, "attemptId": "a1", "watermark": seq}
    await cluster.ledger.append_one(session_id, EPOCH_STARTED, data, lease.epoch)
    return lease, seq


def _record(cluster: Cluster, session_id: str) -> SessionRecord:
    leases = cluster.kernel_server.leases
    assert leases is not None
    record = leases.record(session_id)
    assert record is not None
    return record


def _answer(seq: int) -> dict[str, object]:
    return {"generationId": f"gen-{uuid.uuid4().hex[:8]}", "toolCalls": [], "inputSeqs": [seq]}


async def test_the_answer_settles_the_lease_on_postgres_only(
    cluster: Cluster, settings: Settings
) -> None:
    lease, seq = await _held(cluster, "rt-1")
    settle = Settlement("rt-1", seq, STICKY_MS)

    appended, until_ms = await cluster.ledger.append_settling(
        lease.session_id, ASSISTANT, _answer(seq), lease.epoch, settle
    )

    info = await cluster.kernel.get_lease(lease.session_id)
    if not settings.uses_postgres:
        # SQLite: no shared transaction, so nothing settled; the lease is
        # still held for the runner's Finish.
        assert until_ms == 0
        assert info.lease is not None and info.lease.epoch == lease.epoch
        return
    assert until_ms > 0
    record = _record(cluster, lease.session_id)
    assert record.state is LeaseState.STICKY and record.expires_at_ms == until_ms
    assert record.epoch == lease.epoch and not record.queued
    assert info.lease is None  # kept, not held: no renewal, no Finish
    facts = await cluster.ledger.read_all(lease.session_id)
    assert facts[-1].seq == appended.seq and facts[-1].kind == ASSISTANT


async def test_a_newer_input_or_a_duplicate_leaves_the_lease_to_finish(
    pg_settings: Settings,
) -> None:
    async with running_cluster(pg_settings) as cluster:
        lease, seq = await _held(cluster, "rt-1")
        await cluster.send(lease.session_id, "and another thing", "r2")
        answer = _answer(seq)
        settle = Settlement("rt-1", seq, STICKY_MS)
        _, until_ms = await cluster.ledger.append_settling(
            lease.session_id, ASSISTANT, answer, lease.epoch, settle
        )
        assert until_ms == 0  # the kernel's Finish answers the newer input
        # The same answer again (a retry whose first reply was lost).
        again, until_again = await cluster.ledger.append_settling(
            lease.session_id, ASSISTANT, answer, lease.epoch, settle
        )
        assert again.duplicate and until_again == 0
        info = await cluster.kernel.get_lease(lease.session_id)
        assert info.lease is not None and info.lease.epoch == lease.epoch


async def test_a_fenced_answer_settles_nothing(pg_settings: Settings) -> None:
    async with running_cluster(pg_settings) as cluster:
        lease, seq = await _held(cluster, "rt-1")
        # A successor raised the fence (epoch + 1): the old holder's answer,
        # and the settlement it carries, are refused together.
        successor = {
            "epoch": lease.epoch + 1,
            "runtimeId": "rt-2",
            "attemptId": "a2",
            "watermark": seq,
        }
        await cluster.ledger.append_one(lease.session_id, EPOCH_STARTED, successor, lease.epoch + 1)
        with pytest.raises(StaleEpoch):
            await cluster.ledger.append_settling(
                lease.session_id,
                ASSISTANT,
                _answer(seq),
                lease.epoch,
                Settlement("rt-1", seq, STICKY_MS),
            )
        assert _record(cluster, lease.session_id).state is LeaseState.HELD


@pytest.mark.parametrize(
    ("epoch", "settle", "refusal"),
    [
        (0, Settlement("rt-1", 1, STICKY_MS), InvalidSettlement),  # a client's write
        (1, Settlement("no spaces allowed", 1, STICKY_MS), InvalidId),
        (1, Settlement("rt-1", -1, STICKY_MS), InvalidSettlement),
        (1, Settlement("rt-1", 1, -5), InvalidSettlement),
    ],
)
async def test_a_settlement_that_cannot_be_a_runners_is_refused(
    pg_settings: Settings, epoch: int, settle: Settlement, refusal: type[LedgerError]
) -> None:
    async with running_cluster(pg_settings) as cluster:
        session_id = f"s-{uuid.uuid4().hex[:8]}"
        await cluster.new_session(session_id)
        with pytest.raises(refusal) as refused:
            await cluster.ledger.append_settling(session_id, ASSISTANT, _answer(1), epoch, settle)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [f.kind for f in await cluster.ledger.read_all(session_id)] == ["session_created"]
