"""What must hold in a session's ledger after any crash, handoff or cancel."""

from __future__ import annotations

from collections import Counter

from services.ledger import CommittedFact


def assert_recovered(facts: list[CommittedFact]) -> None:
    assert [f.seq for f in facts] == list(range(1, len(facts) + 1)), "seq gap"
    assert_single_writer(facts)
    assert_each_input_answered_once(facts)
    assert_one_result_per_call(facts)


def assert_single_writer(facts: list[CommittedFact]) -> None:
    """Every runner fact carries the epoch of the latest epoch_started before it."""
    fence = 0
    for fact in facts:
        if fact.kind == "epoch_started":
            assert fact.data["epoch"] > fence
            fence = fact.data["epoch"]
        elif fact.epoch != 0:
            assert fact.epoch == fence, f"seq {fact.seq}: epoch {fact.epoch} under fence {fence}"


def assert_each_input_answered_once(facts: list[CommittedFact]) -> None:
    inputs = [f.seq for f in facts if f.kind == "input"]
    consumed = Counter(
        seq for f in facts if f.kind == "assistant" for seq in f.data.get("inputSeqs") or ()
    )
    assert {s: consumed[s] for s in inputs} == dict.fromkeys(inputs, 1)
    finals = [f for f in facts if f.kind == "assistant" and f.data.get("inputSeqs")]
    generations = [f.data["generationId"] for f in facts if f.kind == "assistant"]
    assert len(generations) == len(set(generations)), "duplicate answer"
    assert all(not f.data.get("toolCalls") for f in finals)


def assert_one_result_per_call(facts: list[CommittedFact]) -> None:
    calls = [c["id"] for f in facts if f.kind == "assistant" for c in f.data.get("toolCalls") or ()]
    results = Counter(f.data["toolCallId"] for f in facts if f.kind == "tool_result")
    assert {c: results[c] for c in calls} == dict.fromkeys(calls, 1)
    assert set(results) == set(calls)
