"""What the model sees in a fork at any s <= N is what it saw in the parent
at s, over random sessions with tool calls, takeovers and compactions, on
both backends (the ledger store directly: the copy is the store's).

A session is built turn by turn as runners write it (inputs, an epoch's
fence, tool calls and results, answers, compactions keeping a suffix); it is
forked at a random N, the fork forked again, and for every s the request a
model would be sent (compaction.transcript.request_messages) is compared.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compaction.transcript import request_messages
from services.common.config import Settings
from services.ledger.errors import InvalidCursor, SessionExists
from services.ledger.facts import FORKED_FROM, CommittedFact, parse_fact
from services.ledger.store import LedgerStore

MAX_BYTES = 1 << 20

# One turn: (tool calls before the answer, a takeover first, a compaction after)
turns = st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.booleans()), min_size=1, max_size=6)


class Writer:
    """Writes a session the way clients and runners do."""

    def __init__(self, store: LedgerStore, session_id: str) -> None:
        self.store = store
        self.session_id = session_id
        self.epoch = 0
        self.calls = 0
        store.create_session(session_id, "t")

    def put(self, kind: str, data: dict[str, object], epoch: int = 0) -> int:
        fact = parse_fact(kind, json.dumps(data), MAX_BYTES)
        return self.store.append(self.session_id, [fact], epoch)[0].seq

    def turn(self, n: int, calls: int, takeover: bool, compact: bool) -> None:
        asked = self.put("input", {"text": f"question {n}", "requestId": f"r{n}"})
        if takeover or self.epoch == 0:
            self.epoch += 1
            started = {"epoch": self.epoch, "runtimeId": "rt", "attemptId": "a", "watermark": asked}
            self.put("epoch_started", started, self.epoch)
        for i in range(calls):
            self.calls += 1
            call = {"id": f"call-{self.calls}", "name": "counter", "arguments": {"i": i}}
            answer = {"generationId": f"g{n}-{i}", "content": [], "toolCalls": [call]}
            self.put("assistant", answer, self.epoch)
            result = {"toolCallId": call["id"], "content": str(i), "isError": False}
            self.put("tool_result", result, self.epoch)
        text = [{"type": "text", "text": f"answer {n}"}]
        final = {"generationId": f"g{n}", "content": text, "toolCalls": [], "inputSeqs": [asked]}
        self.put("assistant", final, self.epoch)
        if compact:
            summary = {"summary": f"up to {n}", "firstKept": asked}
            self.put("compaction", summary, self.epoch)


@pytest.fixture
def store(settings: Settings) -> Iterator[LedgerStore]:
    opened = LedgerStore(settings)
    yield opened
    opened.close()


def _facts(store: LedgerStore, session_id: str) -> list[CommittedFact]:
    return store.read(session_id, 0, 10_000)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=turns, cut=st.floats(0, 1), cut_again=st.floats(0, 1))
def test_a_fork_shows_the_model_what_the_parent_showed(
    store: LedgerStore, plan: list[tuple[int, bool, bool]], cut: float, cut_again: float
) -> None:
    parent = f"p-{uuid.uuid4().hex[:10]}"
    writer = Writer(store, parent)
    for n, (calls, takeover, compact) in enumerate(plan):
        writer.turn(n, calls, takeover, compact)
    parent_facts = _facts(store, parent)
    at = max(1, round(cut * len(parent_facts)))

    fork = f"f-{uuid.uuid4().hex[:10]}"
    assert store.fork_session(parent, fork, at) == at + 1
    fork_facts = _facts(store, fork)
    assert [f.kind for f in fork_facts] == [f.kind for f in parent_facts[:at]] + [FORKED_FROM]
    again_at = max(1, round(cut_again * len(fork_facts)))
    grandchild = f"g-{uuid.uuid4().hex[:10]}"
    store.fork_session(fork, grandchild, again_at)
    grandchild_facts = _facts(store, grandchild)

    for s in range(1, at + 1):
        assert request_messages(fork_facts[:s]) == request_messages(parent_facts[:s]), s
    for s in range(1, again_at + 1):
        assert request_messages(grandchild_facts[:s]) == request_messages(fork_facts[:s]), s
    # The parent is untouched.
    assert _facts(store, parent) == parent_facts


def test_a_fork_past_the_head_or_onto_a_taken_id_is_refused(store: LedgerStore) -> None:
    writer = Writer(store, f"p-{uuid.uuid4().hex[:10]}")
    writer.turn(0, 0, False, False)
    head = len(_facts(store, writer.session_id))
    with pytest.raises(InvalidCursor):
        store.fork_session(writer.session_id, "f-past", head + 1)
    store.fork_session(writer.session_id, "f-taken", head)
    with pytest.raises(SessionExists):
        store.fork_session(writer.session_id, "f-taken", head)
