"""Property tests of the cut point and of repeated compactions on random sessions.

Sessions are built the way a runner builds them: turns of a user message and
assistant steps, each step's tool calls immediately followed by their
results, with compactions committed between steps from the policy's own
preparations (so compaction entries sit where real ones would).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compaction.policy import (
    CompactionEntry,
    CompactionSettings,
    ContextEntry,
    Message,
    MessageEntry,
    TextBlock,
    ToolCallBlock,
    context_indices,
    find_cut_point,
    is_cut_point,
    prepare,
)

PROPERTY_SETTINGS = settings(
    derandomize=True,
    database=None,
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Sizes in tokens; zero-sized messages are allowed on purpose.
sizes = st.integers(min_value=0, max_value=300)


@dataclass(frozen=True)
class Session:
    entries: tuple[ContextEntry, ...]
    keep_recent_tokens: int


def _assistant(tokens: int, call_ids: list[str]) -> MessageEntry:
    calls = tuple(ToolCallBlock(call_id, "tool", {"n": 1}) for call_id in call_ids)
    return MessageEntry(Message("assistant", (TextBlock("a" * (4 * tokens)), *calls)))


def _commit_compaction(entries: list[ContextEntry], keep: int, summary_tokens: int) -> None:
    preparation = prepare(entries, CompactionSettings(keep_recent_tokens=keep))
    if preparation is not None:
        entries.append(CompactionEntry("s" * (4 * summary_tokens), preparation.first_kept_index))


@st.composite
def sessions(draw: st.DrawFn) -> Session:
    keep = draw(st.integers(min_value=0, max_value=1500))
    entries: list[ContextEntry] = []
    call_counter = 0
    for _turn in range(draw(st.integers(min_value=1, max_value=10))):
        entries.append(MessageEntry(Message("user", "u" * (4 * draw(sizes)))))
        for _step in range(draw(st.integers(min_value=1, max_value=4))):
            call_ids = [f"call_{call_counter + n}" for n in range(draw(st.integers(0, 3)))]
            call_counter += len(call_ids)
            entries.append(_assistant(draw(sizes), call_ids))
            for call_id in call_ids:
                result = Message("toolResult", "r" * (4 * draw(sizes)), tool_call_id=call_id)
                entries.append(MessageEntry(result))
            if draw(st.integers(min_value=0, max_value=5)) == 0:
                _commit_compaction(entries, keep, draw(st.integers(0, 200)))
    return Session(tuple(entries), keep)


def _call_positions(entries: tuple[ContextEntry, ...]) -> dict[str, int]:
    """Tool-call id → position of the assistant message that made the call."""
    positions: dict[str, int] = {}
    for position, entry in enumerate(entries):
        if isinstance(entry, MessageEntry) and not isinstance(entry.message.content, str):
            for block in entry.message.content:
                if isinstance(block, ToolCallBlock):
                    positions[block.id] = position
    return positions


def _message_positions(entries: tuple[ContextEntry, ...], start: int, end: int) -> list[int]:
    return [p for p in range(start, end) if isinstance(entries[p], MessageEntry)]


@PROPERTY_SETTINGS
@given(session=sessions(), data=st.data())
def test_cut_never_separates_a_tool_call_from_its_result(
    session: Session, data: st.DataObject
) -> None:
    entries = session.entries
    start = data.draw(st.integers(min_value=0, max_value=len(entries)), label="start")
    end = data.draw(st.integers(min_value=start, max_value=len(entries)), label="end")
    cut = find_cut_point(entries, start, end, session.keep_recent_tokens)

    assert start <= cut.first_kept_index <= max(start, end - 1)
    has_cut_point = any(is_cut_point(entries[p]) for p in range(start, end))
    if has_cut_point:
        kept_first = entries[cut.first_kept_index]
        # The kept part never starts with a tool result.
        assert is_cut_point(kept_first)
        calls = _call_positions(entries)
        for position in range(cut.first_kept_index, end):
            entry = entries[position]
            if isinstance(entry, MessageEntry) and entry.message.role == "toolResult":
                assert entry.message.tool_call_id is not None
                call_position = calls[entry.message.tool_call_id]
                if call_position >= start:
                    assert call_position >= cut.first_kept_index
    if cut.is_split_turn:
        turn_start = entries[cut.turn_start_index]
        assert isinstance(turn_start, MessageEntry) and turn_start.message.role == "user"
        assert start <= cut.turn_start_index < cut.first_kept_index
        # No user message between the turn start and the cut.
        for position in range(cut.turn_start_index + 1, cut.first_kept_index + 1):
            entry = entries[position]
            assert not (isinstance(entry, MessageEntry) and entry.message.role == "user")


@PROPERTY_SETTINGS
@given(session=sessions(), extra_keep=st.integers(min_value=0, max_value=1500))
def test_compaction_keeps_or_summarizes_everything_still_presented(
    session: Session, extra_keep: int
) -> None:
    entries = session.entries
    preparation = prepare(entries, CompactionSettings(keep_recent_tokens=extra_keep))
    previous = [p for p, entry in enumerate(entries) if isinstance(entry, CompactionEntry)]
    range_start = 0
    if previous:
        latest = entries[previous[-1]]
        assert isinstance(latest, CompactionEntry)
        range_start = latest.first_kept_index
    if preparation is None:
        return

    if previous:
        assert preparation.previous_summary == entries[previous[-1]].summary  # type: ignore[union-attr]
    else:
        assert preparation.previous_summary is None

    summarized = list(preparation.summarize_indices)
    prefix = list(preparation.prefix_indices)
    kept = _message_positions(entries, preparation.first_kept_index, len(entries))
    # Every message from the previous first kept entry on is summarized, in
    # the turn prefix or kept, exactly once and in order: nothing is dropped.
    assert summarized + prefix + kept == _message_positions(entries, range_start, len(entries))
    assert summarized or prefix
    assert preparation.messages_to_summarize == tuple(
        entries[p].message  # type: ignore[union-attr]
        for p in summarized
    )

    # Once committed, the next request presents the new summary and then
    # exactly the kept messages.
    committed = (*entries, CompactionEntry("new summary", preparation.first_kept_index))
    assert context_indices(committed) == (len(entries), *kept)


@PROPERTY_SETTINGS
@given(session=sessions())
def test_presented_context_is_summary_then_messages_in_order(session: Session) -> None:
    entries = session.entries
    indices = context_indices(entries)
    compactions = [p for p, entry in enumerate(entries) if isinstance(entry, CompactionEntry)]
    if not compactions:
        assert indices == tuple(_message_positions(entries, 0, len(entries)))
        return
    assert indices[0] == compactions[-1]
    rest = indices[1:]
    assert list(rest) == sorted(rest)
    assert all(isinstance(entries[p], MessageEntry) for p in rest)
