"""Conformance adapter: runs one case of `conformance/compaction-cases.json`.

`run_case(case)` returns the value to compare (`==`) with `case["expect"]`.
It only translates between the case's JSON shape and the policy API; every
rule lives in `compaction.policy`, so cases not in the file behave the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from compaction.policy import (
    CutPoint,
    Preparation,
    context_indices,
    estimate_text_tokens,
    find_cut_point,
    message_from_dict,
    prepare,
    settings_from_dict,
    should_compact,
    to_entries,
)


def _cut_point_json(cut: CutPoint) -> dict[str, object]:
    return {
        "firstKeptIndex": cut.first_kept_index,
        "turnStartIndex": cut.turn_start_index,
        "isSplitTurn": cut.is_split_turn,
    }


def _preparation_json(preparation: Preparation | None) -> dict[str, object] | None:
    if preparation is None:
        return None
    return {
        "firstKeptIndex": preparation.first_kept_index,
        "isSplitTurn": preparation.is_split_turn,
        "turnStartIndex": preparation.turn_start_index,
        "summarizeIndices": list(preparation.summarize_indices),
        "prefixIndices": list(preparation.prefix_indices),
        "previousSummary": preparation.previous_summary,
        "tokensBefore": preparation.tokens_before,
    }


def _estimate_tokens(case: Mapping[str, Any]) -> object:
    message = case["message"]
    if "summary" in message and "content" not in message:
        # A compaction summary (pi's compactionSummary message or a compaction
        # entry) weighs its summary text.
        return estimate_text_tokens(message["summary"])
    return message_from_dict(message).tokens


def _should_compact(case: Mapping[str, Any]) -> object:
    settings = settings_from_dict(case.get("settings"))
    return should_compact(case["contextTokens"], case["contextWindow"], settings)


def _find_cut_point(case: Mapping[str, Any]) -> object:
    entries = to_entries(case["entries"])
    start = case.get("start", 0)
    end = case.get("end", len(entries))
    return _cut_point_json(find_cut_point(entries, start, end, case["keepRecentTokens"]))


def _prepare(case: Mapping[str, Any]) -> object:
    entries = to_entries(case["entries"])
    return _preparation_json(prepare(entries, settings_from_dict(case.get("settings"))))


def _build_context(case: Mapping[str, Any]) -> object:
    return list(context_indices(to_entries(case["entries"])))


_OPERATIONS: dict[str, Callable[[Mapping[str, Any]], object]] = {
    "estimate_tokens": _estimate_tokens,
    "should_compact": _should_compact,
    "find_cut_point": _find_cut_point,
    "prepare": _prepare,
    "build_context": _build_context,
}


def run_case(case: Mapping[str, Any]) -> object:
    """The policy's answer to one conformance case, in the case's JSON shape."""
    operation = _OPERATIONS.get(case["op"])
    if operation is None:
        raise ValueError(f"unknown conformance op {case['op']!r}; known: {sorted(_OPERATIONS)}")
    return operation(case)
