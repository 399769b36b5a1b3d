"""What must hold in a session's ledger after any crash, handoff or cancel."""

from __future__ import annotations

from collections import Counter

from services.ledger import CommittedFact


def assert_recovered(facts: list[CommittedFact]) -> None:
    assert [f.seq for f in facts] == list(range(1, len(facts) + 1)), "seq gap"
    assert_single_writer(facts)
    assert_each_input_answered_once(facts)
    assert_one_result_per_call(facts)
    assert_results_follow_their_calls(facts)
    assert_answers_within_their_watermark(facts)


def assert_single_writer(facts: list[CommittedFact]) -> None:
    """Every runner fact carries the epoch of the latest epoch_started before it."""
    fence = 0
    for fact in facts:
        if fact.kind == "epoch_started":
            assert fact.data["epoch"] > fence
            fence = fact.data["epoch"]
        elif fact.kind == "forked_from":
            fence = 0  # a fork's own epochs start anew after its parent's
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


def assert_results_follow_their_calls(facts: list[CommittedFact]) -> None:
    """A tool result comes after the assistant fact that made its call."""
    called_at: dict[str, int] = {}
    for fact in facts:
        if fact.kind == "assistant":
            for call in fact.data.get("toolCalls") or ():
                called_at.setdefault(call["id"], fact.seq)
        elif fact.kind == "tool_result":
            call_id = fact.data["toolCallId"]
            assert call_id in called_at, f"seq {fact.seq}: a result of {call_id} before its call"


def assert_answers_within_their_watermark(facts: list[CommittedFact]) -> None:
    """An answer consumes only inputs, and only those its epoch fixed as
    its watermark when it started: never an input the epoch had not read.

    A later turn of a sticky session (the same epoch, woken) declares its
    watermark on its answer or compaction: never lower than the epoch's
    before, never past the fact itself."""
    inputs = {f.seq for f in facts if f.kind == "input"}
    watermarks: dict[int, int] = {}
    for fact in facts:
        declared = fact.data.get("watermark")
        if fact.kind == "epoch_started":
            watermarks[fact.data["epoch"]] = fact.data["watermark"]
            continue
        if fact.kind in ("assistant", "compaction") and declared is not None:
            assert fact.epoch in watermarks, f"seq {fact.seq}: epoch {fact.epoch} never started"
            assert watermarks[fact.epoch] <= declared < fact.seq, (
                f"seq {fact.seq} declares watermark {declared} "
                f"(its epoch's was {watermarks[fact.epoch]})"
            )
            watermarks[fact.epoch] = declared
        if fact.kind == "assistant" and fact.data.get("inputSeqs"):
            consumed = fact.data["inputSeqs"]
            strays = [s for s in consumed if s not in inputs]
            assert not strays, f"seq {fact.seq} consumes {strays}, which are not inputs"
            assert fact.epoch in watermarks, f"seq {fact.seq}: epoch {fact.epoch} never started"
            watermark = watermarks[fact.epoch]
            assert max(consumed) <= watermark, (
                f"seq {fact.seq} consumes {consumed} beyond its epoch's watermark {watermark}"
            )


def assert_stream_continuous(seqs: list[int], after: int = 0) -> None:
    """What a client was sent, across its reconnects: every seq after its
    first cursor, once, in order."""
    assert seqs == list(range(after + 1, after + 1 + len(seqs))), f"stream seqs {seqs}"


def assert_handed_over(facts: list[CommittedFact], old_runtime: str, new_runtime: str) -> int:
    """The new runtime took over with the epoch right after the old one's
    last, and nothing of the old epoch follows; returns the old epoch."""
    starts = [f for f in facts if f.kind == "epoch_started"]
    old = [f.data["epoch"] for f in starts if f.data["runtimeId"] == old_runtime]
    assert old, f"{old_runtime} never started an epoch"
    old_epoch: int = max(old)
    successor = next((f for f in starts if f.data["runtimeId"] == new_runtime), None)
    assert successor is not None, f"{new_runtime} never started an epoch"
    assert successor.data["epoch"] == old_epoch + 1, (
        "the successor's epoch is not epoch+1: "
        + ", ".join(f"{f.seq}: epoch {f.data['epoch']} by {f.data['runtimeId']}" for f in starts)
    )
    late = [f.seq for f in facts if f.seq > successor.seq and f.epoch == old_epoch]
    assert not late, f"facts of the old epoch {old_epoch} after the successor's: {late}"
    return old_epoch
