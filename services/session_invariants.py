"""The invariants of a session's ledger, as pure functions of its facts:
what `keel chaos` and the benchmarks that break things (`keel bench drain`,
`soak`, `replicas`) check after the fact. Below both in the layer contract.

Facts are the public API's JSON (`GET /v1/sessions/{id}/events?format=json`):
`{seq, kind, epoch, data}`. Whatever crashed or was handed off, a session's
ledger must show:

- `seq_gap`: seqs 1, 2, 3, … with no gap and no repeat;
- `duplicate_answer`: no input consumed by two answers (an input is answered
  by the final assistant fact listing it in `inputSeqs`);
- `unanswered_input`: once the session has settled, every input answered
  or skipped (`inputs_skipped`: a parked session's failed inputs, settled
  at a person's request);
- `skipped_answered`: no skipped input also answered, before or after;
- `unknown_input`: no answer consuming a seq that is not an input;
- `duplicate_tool_result` / `missing_tool_result` / `orphan_tool_result`:
  exactly one result per tool call id (a missing one only once settled);
- `stale_epoch`: every runner fact written under the epoch of the latest
  `epoch_started` before it (the fence), so nothing from an older owner
  after a newer one took over;
- `epoch_not_newer`: each `epoch_started` raises the fence (a fork's
  `forked_from` lowers it to 0: the copied facts are its parent's epochs).

Each rule is checked independently, so one planted bug is named once per
place it shows rather than hidden behind the first failure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

SEQ_GAP: Final = "seq_gap"
DUPLICATE_ANSWER: Final = "duplicate_answer"
UNANSWERED_INPUT: Final = "unanswered_input"
UNKNOWN_INPUT: Final = "unknown_input"
SKIPPED_ANSWERED: Final = "skipped_answered"
DUPLICATE_TOOL_RESULT: Final = "duplicate_tool_result"
MISSING_TOOL_RESULT: Final = "missing_tool_result"
ORPHAN_TOOL_RESULT: Final = "orphan_tool_result"
STALE_EPOCH: Final = "stale_epoch"
EPOCH_NOT_NEWER: Final = "epoch_not_newer"

RULES: Final = (
    SEQ_GAP,
    DUPLICATE_ANSWER,
    UNANSWERED_INPUT,
    UNKNOWN_INPUT,
    SKIPPED_ANSWERED,
    DUPLICATE_TOOL_RESULT,
    MISSING_TOOL_RESULT,
    ORPHAN_TOOL_RESULT,
    STALE_EPOCH,
    EPOCH_NOT_NEWER,
)
# Rules that count as a doubled outcome (what a duplicate count reports).
DUPLICATE_RULES: Final = frozenset({DUPLICATE_ANSWER, SKIPPED_ANSWERED, DUPLICATE_TOOL_RESULT})

Fact = Mapping[str, Any]


@dataclass(frozen=True)
class Violation:
    session: str
    seq: int
    rule: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session, "seq": self.seq, "rule": self.rule, "detail": self.detail}


def check_session(session: str, facts: Sequence[Fact], *, settled: bool = True) -> list[Violation]:
    """Every violation in `facts` (a session's whole ledger, in read order).

    `settled`: the session has had its chance to finish (its inputs were
    waited for), so unanswered inputs and calls without a result count too.
    """
    found: list[Violation] = []
    for check in (_seqs, _answers, _tool_results, _epochs):
        found.extend(check(session, facts, settled))
    return sorted(found, key=lambda v: (v.seq, RULES.index(v.rule)))


def _data(fact: Fact) -> Mapping[str, Any]:
    data = fact.get("data")
    return data if isinstance(data, Mapping) else {}


def _seqs(session: str, facts: Sequence[Fact], settled: bool) -> list[Violation]:
    found = []
    expected = 1
    for fact in facts:
        seq = int(fact["seq"])
        if seq != expected:
            found.append(
                Violation(session, seq, SEQ_GAP, f"seq {seq} where {expected} was expected")
            )
        expected = seq + 1
    return found


def _answers(session: str, facts: Sequence[Fact], settled: bool) -> list[Violation]:
    found = []
    inputs = {int(f["seq"]) for f in facts if f["kind"] == "input"}
    skipped_by = {
        int(input_seq): int(f["seq"])
        for f in facts
        if f["kind"] == "inputs_skipped"
        for input_seq in _data(f).get("inputSeqs") or ()
    }
    answered_by: dict[int, int] = {}
    for fact in facts:
        if fact["kind"] != "assistant":
            continue
        seq = int(fact["seq"])
        for input_seq in _data(fact).get("inputSeqs") or ():
            if input_seq in skipped_by:
                # Named where the second of the two settlements stands.
                found.append(
                    Violation(
                        session,
                        max(seq, skipped_by[input_seq]),
                        SKIPPED_ANSWERED,
                        f"input {input_seq} answered by seq {seq} and skipped by seq "
                        f"{skipped_by[input_seq]}",
                    )
                )
        for input_seq in _data(fact).get("inputSeqs") or ():
            if input_seq not in inputs:
                found.append(
                    Violation(session, seq, UNKNOWN_INPUT, f"answers seq {input_seq}, no input")
                )
            elif input_seq in answered_by:
                found.append(
                    Violation(
                        session,
                        seq,
                        DUPLICATE_ANSWER,
                        f"input {input_seq} answered again (first by seq {answered_by[input_seq]})",
                    )
                )
            else:
                answered_by[input_seq] = seq
    if settled:
        found.extend(
            Violation(session, seq, UNANSWERED_INPUT, f"input {seq} was never answered")
            for seq in sorted(inputs - answered_by.keys() - skipped_by.keys())
        )
    return found


def _tool_results(session: str, facts: Sequence[Fact], settled: bool) -> list[Violation]:
    found = []
    calls: dict[str, int] = {}
    results: dict[str, int] = {}
    for fact in facts:
        seq, data = int(fact["seq"]), _data(fact)
        if fact["kind"] == "assistant":
            for call in data.get("toolCalls") or ():
                calls.setdefault(str(call.get("id", "")), seq)
        elif fact["kind"] == "tool_result":
            call_id = str(data.get("toolCallId", ""))
            if call_id not in calls:
                found.append(
                    Violation(
                        session, seq, ORPHAN_TOOL_RESULT, f"result for unknown call {call_id}"
                    )
                )
            elif call_id in results:
                found.append(
                    Violation(
                        session,
                        seq,
                        DUPLICATE_TOOL_RESULT,
                        f"call {call_id} has a second result (first at seq {results[call_id]})",
                    )
                )
            else:
                results[call_id] = seq
    if settled:
        found.extend(
            Violation(session, seq, MISSING_TOOL_RESULT, f"call {call_id} has no result")
            for call_id, seq in calls.items()
            if call_id not in results
        )
    return found


def _epochs(session: str, facts: Sequence[Fact], settled: bool) -> list[Violation]:
    found = []
    fence = 0
    for fact in facts:
        seq, epoch = int(fact["seq"]), int(fact.get("epoch") or 0)
        if fact["kind"] == "epoch_started":
            claimed = int(_data(fact).get("epoch", epoch))
            if claimed <= fence:
                found.append(
                    Violation(session, seq, EPOCH_NOT_NEWER, f"epoch {claimed} after epoch {fence}")
                )
            fence = max(fence, claimed)
        elif fact["kind"] == "forked_from":
            # What came before is the parent's: the fork's epochs start anew.
            fence = 0
        elif epoch != 0 and epoch != fence:
            # Epoch 0: a client's fact (input, cancel), written at any time.
            found.append(
                Violation(
                    session,
                    seq,
                    STALE_EPOCH,
                    f"{fact['kind']} of epoch {epoch} under the fence of epoch {fence}",
                )
            )
    return found


def duplicates(violations: Sequence[Violation]) -> int:
    """How many doubled outcomes (answers, tool results) `violations` name."""
    return sum(1 for v in violations if v.rule in DUPLICATE_RULES)
