"""Where to cut: the first entry a compaction keeps verbatim."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compaction.policy.entries import ContextEntry, is_cut_point, is_user_message

NO_TURN_START = -1


@dataclass(frozen=True, slots=True)
class CutPoint:
    """The first kept entry and, for a split turn, where that turn began.

    A cut on a user message is a clean turn boundary (`turn_start_index` is
    -1). A cut on an assistant message splits its turn: the turn's user
    message and everything up to the cut form the turn prefix, which gets its
    own summary.
    """

    first_kept_index: int
    turn_start_index: int
    is_split_turn: bool


def find_cut_point(
    entries: Sequence[ContextEntry], start: int, end: int, keep_recent_tokens: int
) -> CutPoint:
    """Choose the cut over `entries[start:end]`, keeping about
    `keep_recent_tokens` of the newest entries verbatim. Linear in `end - start`.
    """
    if not 0 <= start <= end <= len(entries):
        raise ValueError(f"invalid range [{start}, {end}) over {len(entries)} entries")

    budget_reached_at = _index_reaching_budget(entries, start, end, keep_recent_tokens)
    if budget_reached_at is None:
        # Everything fits: keep from the first cut point on.
        cut = _first_cut_point(entries, start, end)
    else:
        cut = _first_cut_point(entries, budget_reached_at, end)
        if cut is None:
            # The budget was crossed inside trailing tool results, so no cut
            # point follows. Pi then falls back to its first cut point, keeps
            # everything and never compacts again however large the results
            # grow (pi issue #7201). Keel cuts at the nearest cut point before
            # instead: it keeps more than the budget, but it does compact.
            cut = _last_cut_point(entries, start, budget_reached_at)

    if cut is None:
        # No user or assistant message in range (only tool results): nothing
        # can be cut, keep the whole range.
        return CutPoint(start, NO_TURN_START, False)
    if is_user_message(entries[cut]):
        return CutPoint(cut, NO_TURN_START, False)
    turn_start = find_turn_start(entries, cut, start)
    return CutPoint(cut, turn_start, turn_start != NO_TURN_START)


def find_turn_start(entries: Sequence[ContextEntry], index: int, start: int) -> int:
    """The nearest user message at or before `index`, not before `start`
    (-1 if none: the turn began before the range, i.e. in an earlier
    summary, so there is no prefix left to summarize separately)."""
    for position in range(index, start - 1, -1):
        if is_user_message(entries[position]):
            return position
    return NO_TURN_START


def _index_reaching_budget(
    entries: Sequence[ContextEntry], start: int, end: int, keep_recent_tokens: int
) -> int | None:
    """Walking back from the newest entry, the first index at which the summed
    estimates reach the budget. Compaction entries count with their summary;
    zero-token entries are skipped so they never decide the cut."""
    accumulated = 0
    for position in range(end - 1, start - 1, -1):
        tokens = entries[position].tokens
        if tokens == 0:
            continue
        accumulated += tokens
        if accumulated >= keep_recent_tokens:
            return position
    return None


def _first_cut_point(entries: Sequence[ContextEntry], start: int, end: int) -> int | None:
    for position in range(start, end):
        if is_cut_point(entries[position]):
            return position
    return None


def _last_cut_point(entries: Sequence[ContextEntry], start: int, end: int) -> int | None:
    for position in range(end - 1, start - 1, -1):
        if is_cut_point(entries[position]):
            return position
    return None
