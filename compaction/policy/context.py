"""What a model request presents after the system prompt.

Only the latest compaction counts: its summary (as one user message), then
the messages it kept, from its first kept entry up to the compaction, then
every message after it. Earlier compaction entries are never presented: the
latest summary already covers them.
"""

from __future__ import annotations

from collections.abc import Sequence

from compaction.policy.entries import CompactionEntry, ContextEntry, Message, MessageEntry

NO_COMPACTION = -1

SUMMARY_INTRO = (
    "The conversation history before this point was compacted into the following summary:"
)


def wrap_summary(summary: str) -> str:
    """The text of the user message that carries a compaction summary."""
    return f"{SUMMARY_INTRO}\n\n<summary>\n{summary}\n</summary>"


def summary_message(summary: str) -> Message:
    """The user message presenting `summary` to the model.

    Its own `tokens` include the fixed wrapper; the policy's sums work on
    entries, where a compaction weighs its bare summary as pi counts it.
    """
    return Message(role="user", content=wrap_summary(summary))


def latest_compaction_index(entries: Sequence[ContextEntry]) -> int:
    """Position of the newest compaction entry, or -1."""
    for position in range(len(entries) - 1, -1, -1):
        if isinstance(entries[position], CompactionEntry):
            return position
    return NO_COMPACTION


def context_indices(entries: Sequence[ContextEntry]) -> tuple[int, ...]:
    """Positions of the entries presented after the system prompt, in order;
    the latest compaction's own position stands for its summary message."""
    latest = latest_compaction_index(entries)
    if latest == NO_COMPACTION:
        return tuple(_message_positions(entries, 0, len(entries)))
    compaction = entries[latest]
    assert isinstance(compaction, CompactionEntry)
    return (
        latest,
        *_message_positions(entries, compaction.first_kept_index, latest),
        *_message_positions(entries, latest + 1, len(entries)),
    )


def build_context(entries: Sequence[ContextEntry]) -> tuple[Message, ...]:
    """The messages a request presents after the system prompt."""
    messages: list[Message] = []
    for position in context_indices(entries):
        entry = entries[position]
        if isinstance(entry, MessageEntry):
            messages.append(entry.message)
        else:
            messages.append(summary_message(entry.summary))
    return tuple(messages)


def estimate_presented_tokens(entries: Sequence[ContextEntry]) -> int:
    """Sum of the estimates of everything `build_context` would present."""
    return sum(entries[position].tokens for position in context_indices(entries))


def _message_positions(entries: Sequence[ContextEntry], start: int, end: int) -> list[int]:
    return [
        position for position in range(start, end) if isinstance(entries[position], MessageEntry)
    ]
