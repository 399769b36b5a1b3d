"""The runner's context: only what a request can present is parsed, and the
request, its size and the compaction decision are those of the whole list.

The reference is the whole-session parse (`compaction.transcript`), and for
`owed`, the multi-pass fold it replaced, kept here as it was.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from compaction import transcript as whole
from compaction.policy import (
    CompactionEntry,
    CompactionSettings,
    ContextEntry,
    MessageEntry,
    plan_compaction,
)
from services.ledger.facts import CommittedFact
from services.runner import transcript as T

WINDOW = 3_000
SETTINGS = CompactionSettings(
    enabled=True, reserve_tokens=500, keep_recent_tokens=400, threshold=None
)


class Session:
    def __init__(self) -> None:
        self.facts: list[CommittedFact] = []

    def add(self, kind: str, data: dict[str, Any]) -> int:
        seq = len(self.facts) + 1
        self.facts.append(CommittedFact("s", seq, kind, data, 1000 + seq, 1))
        return seq


def random_session(rng: random.Random, turns: int) -> list[CommittedFact]:
    """Turns of inputs, tool round trips, inputs arriving mid-call, cancelled
    exchanges and compactions (some keeping older compactions in their range)."""
    session = Session()
    session.add("session_created", {"tenantId": "t"})
    unanswered: list[int] = []
    calls = 0
    for turn in range(turns):
        for _ in range(rng.randint(1, 2)):
            text = "é数" * rng.randint(1, 300)
            unanswered.append(session.add("input", {"text": text, "requestId": f"r{turn}-{_}"}))
        watermark = unanswered[-1]
        session.add("epoch_started", {"epoch": turn + 1, "watermark": watermark})
        if turn and rng.random() < 0.3:
            first_kept = rng.randint(max(1, len(session.facts) - 40), len(session.facts))
            session.add(
                "compaction", {"summary": "s" * rng.randint(5, 800), "firstKept": first_kept}
            )
        for step in range(rng.randint(0, 2)):
            calls += 1
            call = {"id": f"c{calls}", "name": "tool", "arguments": {"n": calls}}
            answer: dict[str, Any] = {
                "generationId": f"g{turn}-{step}",
                "content": [{"type": "text", "text": "x" * rng.randint(0, 400)}],
                "toolCalls": [call],
                "stopReason": "toolUse",
            }
            if rng.random() < 0.5:
                answer["usage"] = {"input": rng.randint(1, 2_500), "output": 10}
            session.add("assistant", answer)
            if rng.random() < 0.2:
                text = f"mid-call {turn}"
                unanswered.append(session.add("input", {"text": text, "requestId": text}))
            session.add("tool_result", {"toolCallId": call["id"], "content": "y" * 300})
        answered = [seq for seq in unanswered if seq <= watermark]
        if rng.random() < 0.1:
            session.add("cancelled", {})
            stop = "cancelled"
        else:
            stop = "stop"
        final: dict[str, Any] = {
            "generationId": f"g{turn}-final",
            "content": [{"type": "text", "text": "done"}],
            "toolCalls": [],
            "inputSeqs": answered,
            "stopReason": stop,
        }
        if rng.random() < 0.5:
            final["usage"] = {"input": rng.randint(1, 2_500), "output": 5}
        session.add("assistant", final)
        unanswered = [seq for seq in unanswered if seq > watermark]
    return session.facts


def _seq_at(entries: Sequence[ContextEntry], position: int) -> int | None:
    return entries[position].seq if position < len(entries) else None


def assert_same_request(facts: Sequence[CommittedFact], watermark: int | None) -> None:
    windowed = T.windowed_context(facts, watermark, {})
    full = whole.parsed_context(facts, watermark)
    assert len(windowed) <= len(full)
    # The windowed list is the end of the whole one (compactions re-pointed).
    offset = len(full) - len(windowed)
    for mine, theirs in zip(windowed, full[offset:], strict=True):
        assert mine.seq == theirs.seq
        if isinstance(theirs, CompactionEntry):
            assert isinstance(mine, CompactionEntry)
            assert mine.first_kept_index + offset == theirs.first_kept_index
        else:
            assert mine == theirs
    assert T.presented_request(windowed) == T.presented_request(full)
    mine_plan = plan_compaction(windowed, SETTINGS, WINDOW)
    their_plan = plan_compaction(full, SETTINGS, WINDOW)
    assert mine_plan.context_tokens == their_plan.context_tokens
    assert mine_plan.should_compact == their_plan.should_compact
    mine_prep, their_prep = mine_plan.preparation, their_plan.preparation
    assert (mine_prep is None) == (their_prep is None)
    if mine_prep is not None and their_prep is not None:
        assert _seq_at(windowed, mine_prep.first_kept_index) == _seq_at(
            full, their_prep.first_kept_index
        )
        assert mine_prep.is_split_turn == their_prep.is_split_turn
        assert mine_prep.previous_summary == their_prep.previous_summary
        assert mine_prep.tokens_before == their_prep.tokens_before
        assert mine_prep.tokens_kept == their_prep.tokens_kept
        assert mine_prep.messages_to_summarize == their_prep.messages_to_summarize
        assert mine_prep.turn_prefix_messages == their_prep.turn_prefix_messages


@pytest.mark.parametrize("seed", range(12))
def test_the_window_presents_and_plans_as_the_whole_list(seed: int) -> None:
    facts = random_session(random.Random(seed), turns=30)
    for head in range(1, len(facts) + 1, 3):
        prefix = facts[:head]
        for watermark in (None, T.read_through(prefix), max(T.read_through(prefix) - 2, 0)):
            assert_same_request(prefix, watermark)


def test_only_the_window_is_parsed_and_the_memo_carries_it() -> None:
    facts = random_session(random.Random(99), turns=60)
    compactions = [f for f in facts if f.kind == "compaction"]
    assert compactions, "the session compacts"
    memo: dict[int, MessageEntry] = {}
    windowed = T.windowed_context(facts, None, memo)
    full = whole.parsed_context(facts, None)
    assert len(windowed) < len(full)
    assert set(memo) == {e.seq for e in windowed if isinstance(e, MessageEntry)}
    again = T.windowed_context(facts, None, memo)
    assert all(a is b for a, b in zip(windowed, again, strict=True) if a.seq in memo)


def test_a_compaction_kept_by_a_later_one_stays_pointing_inside_the_window() -> None:
    session = Session()
    session.add("session_created", {"tenantId": "t"})
    first = session.add("input", {"text": "one", "requestId": "r1"})
    session.add("epoch_started", {"epoch": 1, "watermark": first})
    session.add(
        "assistant",
        {"generationId": "g1", "content": [], "toolCalls": [], "inputSeqs": [first]},
    )
    second = session.add("input", {"text": "two", "requestId": "r2"})
    session.add("epoch_started", {"epoch": 2, "watermark": second})
    session.add("compaction", {"summary": "older", "firstKept": first})
    session.add(
        "assistant",
        {"generationId": "g2", "content": [], "toolCalls": [], "inputSeqs": [second]},
    )
    third = session.add("input", {"text": "three", "requestId": "r3"})
    session.add("epoch_started", {"epoch": 3, "watermark": third})
    # Keeps from the second input: the older compaction is inside its range
    # and points before it.
    session.add("compaction", {"summary": "newer", "firstKept": second})
    windowed = T.windowed_context(session.facts, third, {})
    assert windowed[0].seq == first
    assert_same_request(session.facts, third)


def reference_owed(facts: Sequence[CommittedFact], watermark: int) -> tuple[Any, ...]:
    """`owed`'s figures as the several passes it replaced computed them."""
    fold = whole.fold_facts(facts)
    latest_cancel = max((f.seq for f in facts if f.kind == "cancelled"), default=0)
    inputs = [f.seq for f in facts if f.kind == "input" and f.seq <= watermark]
    unanswered = [s for s in inputs if s not in fold.consumed]
    latest = next((f for f in reversed(facts) if f.kind == "assistant"), None)
    open_ids = tuple(
        call["id"]
        for call in (latest.data.get("toolCalls") or () if latest is not None else ())
        if call["id"] not in fold.results
    )
    return (
        tuple(s for s in unanswered if s > latest_cancel),
        tuple(s for s in unanswered if s < latest_cancel),
        latest_cancel,
        whole.context_head(facts, watermark),
        open_ids,
    )


@pytest.mark.parametrize("seed", range(6))
def test_owed_in_one_pass_finds_what_the_passes_found(seed: int) -> None:
    facts = random_session(random.Random(1000 + seed), turns=25)
    for head in range(1, len(facts) + 1):
        prefix = facts[:head]
        for watermark in (0, T.read_through(prefix), max(T.read_through(prefix) - 3, 0)):
            owed = T.owed(prefix, watermark)
            figures = (
                owed.input_seqs,
                owed.cancelled_input_seqs,
                owed.latest_cancel_seq,
                owed.context_head_seq,
                tuple(c.tool_call_id for c in (*owed.open_calls, *owed.waiting_calls)),
            )
            assert figures == reference_owed(prefix, watermark)
