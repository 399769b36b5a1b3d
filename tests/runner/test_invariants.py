"""The recovery invariants catch what they claim to: a ledger that breaks one
of them (built here by hand, fact by fact) fails `assert_recovered`, and the
same ledger without the break passes."""

from __future__ import annotations

from typing import Any

import pytest

from services.ledger import CommittedFact
from tests.support.ledger_invariants import assert_recovered


def ledger(*facts: tuple[str, dict[str, Any], int]) -> list[CommittedFact]:
    """Facts as (kind, data, epoch), numbered from seq 1."""
    return [
        CommittedFact("s", seq, kind, data, 0, epoch)
        for seq, (kind, data, epoch) in enumerate(facts, start=1)
    ]


def started(epoch: int, watermark: int) -> tuple[str, dict[str, Any], int]:
    return ("epoch_started", {"epoch": epoch, "watermark": watermark}, epoch)


def asked(text: str) -> tuple[str, dict[str, Any], int]:
    return ("input", {"text": text}, 0)


def call(generation: str, call_id: str, epoch: int) -> tuple[str, dict[str, Any], int]:
    return (
        "assistant",
        {"generationId": generation, "toolCalls": [{"id": call_id, "name": "clock"}]},
        epoch,
    )


def result(call_id: str, epoch: int) -> tuple[str, dict[str, Any], int]:
    return ("tool_result", {"toolCallId": call_id, "content": "ok"}, epoch)


def answer(generation: str, seqs: list[int], epoch: int) -> tuple[str, dict[str, Any], int]:
    return ("assistant", {"generationId": generation, "inputSeqs": seqs}, epoch)


def test_a_ledger_that_keeps_every_invariant_passes() -> None:
    assert_recovered(
        ledger(
            asked("hello"),  # 1
            started(1, 1),  # 2
            call("g1", "c1", 1),  # 3
            result("c1", 1),  # 4
            started(2, 4),  # 5
            answer("g2", [1], 2),  # 6
        )
    )


def test_a_result_before_its_call_fails() -> None:
    facts = ledger(
        asked("hello"),  # 1
        started(1, 1),  # 2
        result("c1", 1),  # 3
        call("g1", "c1", 1),  # 4
        answer("g2", [1], 1),  # 5
    )
    with pytest.raises(AssertionError, match="a result of c1 before its call"):
        assert_recovered(facts)


def test_an_answer_consuming_a_seq_that_is_no_input_fails() -> None:
    facts = ledger(
        asked("hello"),  # 1
        started(1, 2),  # 2
        # Consumes seq 2, the epoch_started, as if it were an input.
        answer("g1", [1, 2], 1),  # 3
    )
    with pytest.raises(AssertionError, match=r"consumes \[2\], which are not inputs"):
        assert_recovered(facts)


def test_an_answer_beyond_its_epochs_watermark_fails() -> None:
    facts = ledger(
        asked("first"),  # 1
        started(1, 1),  # 2
        asked("second"),  # 3: after the watermark epoch 1 fixed
        answer("g1", [1, 3], 1),  # 4
    )
    with pytest.raises(AssertionError, match="beyond its epoch's watermark 1"):
        assert_recovered(facts)


def test_the_watermark_is_that_of_the_answers_own_epoch() -> None:
    # Epoch 2 read through seq 5; its answer of seq 5 is within it, though
    # epoch 1's watermark (1) is lower.
    assert_recovered(
        ledger(
            asked("first"),  # 1
            started(1, 1),  # 2
            answer("g1", [1], 1),  # 3
            asked("second"),  # 4
            asked("third"),  # 5
            started(2, 5),  # 6
            answer("g2", [4, 5], 2),  # 7
        )
    )
