"""What a compaction would summarize and keep, before any model is called."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compaction.policy.context import NO_COMPACTION, context_indices, latest_compaction_index
from compaction.policy.cutpoint import find_cut_point
from compaction.policy.entries import CompactionEntry, ContextEntry, Message, MessageEntry
from compaction.policy.tokens import estimate_text_tokens
from compaction.policy.trigger import (
    CompactionSettings,
    compaction_limit,
    estimate_context_tokens,
    should_compact,
)


@dataclass(frozen=True, slots=True)
class Preparation:
    """A compaction ready to be summarized. Indices are entry positions.

    `summarize_indices` are the messages the history summary covers,
    `prefix_indices` the start of a split turn (summarized on its own).
    `previous_summary` is the latest compaction's summary, which the new
    summary updates. `tokens_kept` is the estimate of the messages kept
    verbatim (`first_kept_index` to the end), so the context after the
    compaction is `estimate_text_tokens(summary) + tokens_kept`.
    """

    first_kept_index: int
    is_split_turn: bool
    turn_start_index: int
    summarize_indices: tuple[int, ...]
    prefix_indices: tuple[int, ...]
    previous_summary: str | None
    tokens_before: int
    tokens_kept: int
    messages_to_summarize: tuple[Message, ...]
    turn_prefix_messages: tuple[Message, ...]

    @property
    def covered_indices(self) -> tuple[int, ...]:
        """Every message position the new summary stands for."""
        return self.summarize_indices + self.prefix_indices


def prepare(entries: Sequence[ContextEntry], settings: CompactionSettings) -> Preparation | None:
    """Plan a compaction of `entries`, or None when there is nothing to compact."""
    if entries and isinstance(entries[-1], CompactionEntry):
        return None

    latest = latest_compaction_index(entries)
    previous = entries[latest] if latest != NO_COMPACTION else None
    assert previous is None or isinstance(previous, CompactionEntry)
    # The range starts at the previous compaction's first kept entry, not just
    # after the compaction entry as in pi: the messages it kept before itself
    # are still presented, so they must be kept or summarized now. Pi skipped
    # them and they vanished from the context (pi issue #2608).
    range_start = previous.first_kept_index if previous is not None else 0
    cut = find_cut_point(entries, range_start, len(entries), settings.keep_recent_tokens)

    history_end = cut.turn_start_index if cut.is_split_turn else cut.first_kept_index
    summarize = _message_positions(entries, range_start, history_end)
    prefix = (
        _message_positions(entries, cut.turn_start_index, cut.first_kept_index)
        if cut.is_split_turn
        else []
    )
    if not summarize and not prefix:
        return None

    kept = _message_positions(entries, cut.first_kept_index, len(entries))
    return Preparation(
        first_kept_index=cut.first_kept_index,
        is_split_turn=cut.is_split_turn,
        turn_start_index=cut.turn_start_index,
        summarize_indices=tuple(summarize),
        prefix_indices=tuple(prefix),
        # Carried even when only a turn prefix is summarized: pi then wrote a
        # summary of the prefix alone and the earlier history was lost.
        previous_summary=previous.summary if previous is not None else None,
        tokens_before=sum(entries[position].tokens for position in context_indices(entries)),
        tokens_kept=sum(entries[position].tokens for position in kept),
        messages_to_summarize=_messages_at(entries, summarize),
        turn_prefix_messages=_messages_at(entries, prefix),
    )


def tokens_after(preparation: Preparation, summary: str) -> int:
    """Estimated context once the compaction with `summary` is committed."""
    return estimate_text_tokens(summary) + preparation.tokens_kept


def would_reduce(preparation: Preparation, summary: str) -> bool:
    """Whether committing `summary` shrinks the context; a compaction that
    does not is not committed (it would only add a fact and cost a call)."""
    return tokens_after(preparation, summary) < preparation.tokens_before


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """Everything a caller needs to decide on a compaction.

    `should_compact` applies the trigger; `preparation` is computed whatever
    the trigger says (None when there is nothing to compact), so an overflow
    or a manual request can compact below the limit.
    """

    context_tokens: int
    context_window: int
    limit: int
    should_compact: bool
    preparation: Preparation | None


def plan_compaction(
    entries: Sequence[ContextEntry], settings: CompactionSettings, context_window: int
) -> CompactionPlan:
    """The trigger decision plus the prepared compaction; linear in the
    number of entries."""
    context_tokens = estimate_context_tokens(entries)
    limit = compaction_limit(context_window, settings)
    return CompactionPlan(
        context_tokens=context_tokens,
        context_window=context_window,
        limit=limit,
        should_compact=should_compact(context_tokens, context_window, settings),
        preparation=prepare(entries, settings),
    )


def _message_positions(entries: Sequence[ContextEntry], start: int, end: int) -> list[int]:
    # Compaction entries inside a range are never summarized as messages: the
    # latest one's summary travels as `previous_summary`, older ones are
    # already folded into it.
    return [
        position for position in range(start, end) if isinstance(entries[position], MessageEntry)
    ]


def _messages_at(entries: Sequence[ContextEntry], positions: list[int]) -> tuple[Message, ...]:
    messages: list[Message] = []
    for position in positions:
        entry = entries[position]
        assert isinstance(entry, MessageEntry)
        messages.append(entry.message)
    return tuple(messages)
