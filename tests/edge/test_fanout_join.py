"""A stream that starts while facts are being committed misses none of them.

The first client of a session starts the edge's ledger subscription, and its
own backlog is read at the same time. A fact committed after the backlog's
read and before the subscription read its starting head belongs to
neither; it used to reach the client only with a later fact, and never when
none came (the last answer of a turn). The ledger client below orders the
two reads that way every time (the ledger is real; only the order of two
calls is forced).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from edge.fanout import FanoutHub
from services.common.config import Settings
from services.ledger import CommittedFact, LedgerClient, SessionView
from tests.support.edge_stack import Stack


class CommitBetweenTheReads(LedgerClient):
    """Commits one fact after the backlog read and before the subscription
    asks for the head it starts after."""

    def __init__(self, target: str, settings: Settings) -> None:
        super().__init__(target, settings)
        self.backlog_read = asyncio.Event()
        self.committed: int | None = None

    async def read(
        self, session_id: str, after_seq: int = 0, limit: int = 0
    ) -> tuple[list[CommittedFact], int]:
        result = await super().read(session_id, after_seq, limit)
        self.backlog_read.set()
        return result

    async def get_session(self, session_id: str) -> SessionView:
        if self.committed is None:
            await self.backlog_read.wait()
            data: dict[str, Any] = {"text": "in between", "requestId": "between"}
            self.committed = (await self.append_one(session_id, "input", data)).seq
        return await super().get_session(session_id)


async def no_runner(_: str) -> None:
    return None


async def test_a_fact_committed_between_backlog_and_subscription_reaches_the_client(
    stack: Stack,
) -> None:
    session = await stack.new_session()
    ledger_id = stack.ledger_id(session)
    head = (await stack.cluster.ledger.get_session(ledger_id)).head_seq
    ledger = CommitBetweenTheReads(stack.cluster.ledger_server.target, stack.cluster.settings)
    hub = FanoutHub(ledger, no_runner, no_runner)
    seen: list[int] = []
    try:
        async with asyncio.timeout(10), contextlib.aclosing(hub.follow(ledger_id, head)) as follow:
            async for batch in follow:
                seen.extend(item.seq for item in batch if isinstance(item, CommittedFact))
                if ledger.committed is not None and ledger.committed in seen:
                    break
    finally:
        await ledger.close()
    assert seen == [head + 1] == [ledger.committed]
