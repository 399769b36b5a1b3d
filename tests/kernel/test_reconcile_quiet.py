"""The reconciler is quiet when healthy: it enqueues every owing session it
finds neither queued nor leased, but warns only about work really stuck —
not about an answer that lands between its listing and its look-up, nor
about an input whose wake-up is still on its way.

Real ledger over gRPC, real kernel store on PostgreSQL; the reconciler's
clock is the only thing set by hand, so "past the grace" needs no waiting."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator

import pytest

from kernel.reconcile import Reconciler
from services.common.config import Settings
from services.ledger import LedgerClient, LedgerServer
from services.ledger.client import SessionPage
from tests.support.cluster import running_ledger
from tests.support.kernel_stores import Stores, open_stores

GRACE_MS = 10_000
RUNTIME = "r1"
LOGGER = "kernel.reconcile"


class AnsweredWhileListing(Reconciler):
    """The race made deterministic: the runner commits its answer and
    finishes its lease right after the reconciler reads the page."""

    def __init__(self, *args: object, answer: LedgerClient, stores: Stores, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._answer = answer
        self._stores = stores

    async def _owing_page(self, after: str) -> SessionPage:
        page = await super()._owing_page(after)
        for summary in page.sessions:
            lease = self._stores.leases.get_lease(summary.session_id).lease
            assert lease is not None
            owed = (await self._answer.get_session(summary.session_id)).owed_input_seqs
            await self._answer.append_one(
                summary.session_id,
                "assistant",
                {"generationId": "g1", "inputSeqs": list(owed)},
                epoch=lease.epoch,
            )
            self._stores.leases.finish(summary.session_id, lease.epoch, RUNTIME, max(owed))
        return page


@pytest.fixture
def stores(pg_settings: Settings) -> Iterator[Stores]:
    opened = open_stores(pg_settings)
    opened.register(RUNTIME)
    yield opened
    opened.database.close()


@pytest.fixture
async def ledger_server(pg_settings: Settings) -> AsyncIterator[LedgerServer]:
    async with running_ledger(pg_settings) as server:
        yield server


@pytest.fixture
async def ledger(ledger_server: LedgerServer, pg_settings: Settings) -> AsyncIterator[LedgerClient]:
    async with LedgerClient(ledger_server.target, pg_settings) as client:
        yield client


async def owing_session(ledger: LedgerClient, session_id: str) -> int:
    """A session with one input committed and no wake-up sent; its commit time."""
    await ledger.create_session(session_id, "t1")
    await ledger.append_one(session_id, "input", {"text": "hi", "requestId": "r1"})
    facts, _ = await ledger.read(session_id)
    return facts[-1].timestamp_ms


def queued(stores: Stores, session_id: str) -> bool:
    record = stores.leases.record(session_id)
    return record is not None and record.queued


def reported(caplog: pytest.LogCaptureFixture, session_id: str) -> list[logging.LogRecord]:
    """What an operator sees about the session (INFO and above)."""
    return [
        r
        for r in caplog.records
        if r.name == LOGGER and r.levelno >= logging.INFO and session_id in r.getMessage()
    ]


async def test_an_answer_landing_after_the_listing_is_not_reported(
    pg_settings: Settings,
    stores: Stores,
    ledger_server: LedgerServer,
    ledger: LedgerClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    committed_ms = await owing_session(ledger, "s-race")
    stores.leases.enqueue("s-race", "t1", 2, False)
    lease = stores.leases.claim(RUNTIME)
    assert lease is not None
    await ledger.append_one(
        "s-race",
        "epoch_started",
        {"epoch": lease.epoch, "runtimeId": RUNTIME, "attemptId": "a1", "watermark": 0},
        epoch=lease.epoch,
    )
    reconciler = AnsweredWhileListing(
        stores.leases,
        ledger_server.target,
        pg_settings,
        100,
        GRACE_MS,
        # Long past the grace: only the moved head may keep it quiet.
        clock=lambda: committed_ms + 10 * GRACE_MS,
        answer=ledger,
        stores=stores,
    )
    caplog.set_level(logging.DEBUG, LOGGER)
    try:
        assert await reconciler.reconcile_once() == 1, "the spurious wake-up is still sent"
    finally:
        await reconciler.close()
    assert queued(stores, "s-race")
    assert reported(caplog, "s-race") == []
    assert reconciler.stuck == 0


@pytest.mark.parametrize(("owed_for_ms", "stuck"), [(GRACE_MS // 10, False), (GRACE_MS, True)])
async def test_only_work_owed_past_the_grace_is_warned_about(
    pg_settings: Settings,
    stores: Stores,
    ledger_server: LedgerServer,
    ledger: LedgerClient,
    caplog: pytest.LogCaptureFixture,
    owed_for_ms: int,
    stuck: bool,
) -> None:
    committed_ms = await owing_session(ledger, "s-lost")
    reconciler = Reconciler(
        stores.leases,
        ledger_server.target,
        pg_settings,
        100,
        GRACE_MS,
        clock=lambda: committed_ms + owed_for_ms,
    )
    caplog.set_level(logging.DEBUG, LOGGER)
    try:
        assert await reconciler.reconcile_once() == 1
        # Queued now: the next pass neither enqueues nor says anything again.
        assert await reconciler.reconcile_once() == 0
    finally:
        await reconciler.close()
    assert queued(stores, "s-lost")
    lines = reported(caplog, "s-lost")
    if stuck:
        assert [(r.levelno, f"owed work for {GRACE_MS} ms" in r.getMessage()) for r in lines] == [
            (logging.WARNING, True)
        ]
    else:
        assert lines == []
    assert reconciler.stuck == int(stuck)
