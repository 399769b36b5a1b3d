"""The facts of sessions this runner worked on recently, kept between attempts.

A committed fact never changes and a session's seqs have no gaps, so a copy
read earlier stays true forever: a new attempt on a session this runner has
seen reads only the facts after the copy's tail, instead of the whole session
on every claim (the cost of a turn would otherwise grow with the session's
length). Nothing here decides what is owed; the attempt still works from the
ledger's facts, only fewer of them travel.

The facts an attempt committed itself are kept as it wrote them (see
`Attempt.commit`): equal to the ledger's but for the timestamp, which the
runner never reads.

Each session's parsed context messages travel with its facts, for the same
reason: a message parsed once never needs parsing again.

Bounded by a total number of facts; the least recently used sessions go first.

A session read from the start (a successor without a copy) is read a few
pages at a time: once the first page has said where the head is, the rest
are known seq ranges, so the ledger prepares the next pages while this
process decodes the previous ones instead of each side waiting for the other.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from compaction.policy import MessageEntry
from services.ledger import LedgerClient
from services.ledger.facts import MAX_READ_LIMIT, CommittedFact

# Pages asked for at once beyond the first: enough to keep both sides busy,
# few enough not to crowd out the ledger's other readers.
PAGES_IN_FLIGHT = 4


@dataclass
class SessionHistory:
    """A session's facts from seq 1 on, and its context messages parsed so far."""

    facts: list[CommittedFact] = field(default_factory=list)
    # seq -> parsed message entry (see services.runner.transcript.windowed_context)
    parsed: dict[int, MessageEntry] = field(default_factory=dict)


class FactCache:
    def __init__(
        self,
        ledger: LedgerClient,
        max_facts: int,
        on_evict: Callable[[str], None] = lambda session_id: None,
    ) -> None:
        self._ledger = ledger
        self._max_facts = max_facts
        # Told of each session dropped to stay within the bound.
        self._on_evict = on_evict
        self._sessions: OrderedDict[str, SessionHistory] = OrderedDict()
        self._size = 0

    @property
    def size(self) -> int:
        """Facts held, over every session."""
        return self._size

    async def load(self, session_id: str, arrived: Sequence[CommittedFact] = ()) -> SessionHistory:
        """Every fact of the session: the kept copy plus what the ledger has after it.

        `arrived`: facts that came with a wake (its input). When they follow
        the kept copy's tail with no gap, they are what comes after it as far
        as this turn needs, and nothing is read: a fact committed after them
        wakes or re-queues the session in its turn.

        The caller owns the returned history; give it back with `keep()`.
        """
        history = self._take(session_id)
        after = history.facts[-1].seq if history.facts else 0
        if history.facts and _follows(arrived, after):
            history.facts.extend(arrived)
            return history
        history.facts.extend(await self._read_after(session_id, after))
        return history

    async def _read_after(self, session_id: str, after: int) -> list[CommittedFact]:
        """What `LedgerClient.read_all` returns, with pages read concurrently."""
        facts, head = await self._ledger.read(session_id, after, MAX_READ_LIMIT)
        if not facts or facts[-1].seq >= head:
            return facts
        gate = asyncio.Semaphore(PAGES_IN_FLIGHT)

        async def page(start: int) -> tuple[list[CommittedFact], int]:
            async with gate:
                return await self._ledger.read(session_id, start, MAX_READ_LIMIT)

        # Seqs have no gaps: the pages up to the head are these ranges.
        starts = range(facts[-1].seq, head, MAX_READ_LIMIT)
        pages = await asyncio.gather(*(page(s) for s in starts))
        for page_facts, _ in pages:
            if not page_facts or page_facts[0].seq != facts[-1].seq + 1:
                break  # not the expected range: the rest page by page below
            facts.extend(page_facts)
        # Any page may have seen facts appended since the first was read.
        head = max(head, *(page_head for _, page_head in pages))
        if facts[-1].seq < head:
            # Appended while reading (or a page not as expected): from there on.
            facts.extend(await self._ledger.read_all(session_id, facts[-1].seq))
        return facts

    def keep(self, session_id: str, history: SessionHistory) -> None:
        """Remembers a session's history, if its facts are the complete prefix."""
        self._take(session_id)
        facts = history.facts
        if not facts or not _complete_prefix(facts) or len(facts) > self._max_facts:
            return
        self._sessions[session_id] = history
        self._size += len(facts)
        while self._size > self._max_facts:
            evicted_id, evicted = self._sessions.popitem(last=False)
            self._size -= len(evicted.facts)
            self._on_evict(evicted_id)

    def _take(self, session_id: str) -> SessionHistory:
        history = self._sessions.pop(session_id, None)
        if history is None:
            return SessionHistory()
        self._size -= len(history.facts)
        return history


def _follows(arrived: Sequence[CommittedFact], after: int) -> bool:
    return bool(arrived) and all(f.seq == after + 1 + i for i, f in enumerate(arrived))


def _complete_prefix(facts: Sequence[CommittedFact]) -> bool:
    # Seqs start at 1 and have no gaps: checking both ends is enough for a
    # list built by appending facts in seq order.
    return facts[0].seq == 1 and facts[-1].seq == len(facts)
