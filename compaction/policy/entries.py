"""Context entries: the messages and compactions the policy reasons about.

JSON shape (the conformance cases' and the one the compaction service builds
from ledger facts), in ledger order:

    {"type": "message", "message": {"role": ..., "content": ...}, "seq"?: int}
    {"type": "compaction", "summary": str, "firstKeptIndex": int, "seq"?: int}

`firstKeptIndex` is a position in the same entry list (the first message the
compaction kept). `seq` is optional and only carried so callers can map
indices back to ledger positions; the policy never reads it.

Every entry's token estimate is computed once, when it is built, so the
policy's walks over a long session only add integers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from compaction.policy.blocks import (
    ROLES,
    Content,
    Role,
    content_from_json,
    content_to_json,
    unmodelled_fields,
)
from compaction.policy.tokens import content_chars, estimate_text_tokens, tokens_for_chars

# Stop reasons of an assistant message that did not complete; its usage figure
# is not a measure of the context and is ignored.
UNSUCCESSFUL_STOP_REASONS = frozenset({"error", "aborted"})


@dataclass(frozen=True, slots=True)
class Usage:
    """Provider-reported token usage of one assistant response (pi's field names)."""

    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    total_tokens: int = 0

    @property
    def context_tokens(self) -> int:
        """Tokens the request plus its response occupy in the context window."""
        if self.total_tokens > 0:
            return self.total_tokens
        return self.input + self.output + self.cache_read + self.cache_write


@dataclass(frozen=True, slots=True)
class Message:
    """One transcript message. `tokens` is its estimate (see tokens.py)."""

    role: Role
    content: Content
    tool_call_id: str | None = None
    usage: Usage | None = None
    stop_reason: str | None = None
    # Fields not modelled here (toolName, isError, timestamp…), kept for to_dict.
    extra: Mapping[str, object] = field(default_factory=dict, repr=False)
    tokens: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tokens_for_chars(content_chars(self.role, self.content)))

    @property
    def reported_context_tokens(self) -> int | None:
        """The usage figure this message contributes, if it is a trustworthy one.

        Only a completed assistant response measures the context; a zero figure
        (some providers report nothing) counts as no figure at all.
        """
        if self.role != "assistant" or self.usage is None:
            return None
        if self.stop_reason in UNSUCCESSFUL_STOP_REASONS:
            return None
        tokens = self.usage.context_tokens
        return tokens if tokens > 0 else None

    def to_dict(self) -> dict[str, object]:
        """The JSON shape of the message (inverse of `message_from_dict`)."""
        result: dict[str, object] = {
            **self.extra,
            "role": self.role,
            "content": content_to_json(self.content),
        }
        if self.tool_call_id is not None:
            result["toolCallId"] = self.tool_call_id
        if self.stop_reason is not None:
            result["stopReason"] = self.stop_reason
        if self.usage is not None:
            result["usage"] = {
                "input": self.usage.input,
                "output": self.usage.output,
                "cacheRead": self.usage.cache_read,
                "cacheWrite": self.usage.cache_write,
                "totalTokens": self.usage.total_tokens,
            }
        return result


@dataclass(frozen=True, slots=True)
class MessageEntry:
    message: Message
    seq: int | None = None

    @property
    def tokens(self) -> int:
        return self.message.tokens


@dataclass(frozen=True, slots=True)
class CompactionEntry:
    """A committed compaction. It weighs its summary text."""

    summary: str
    first_kept_index: int
    seq: int | None = None
    tokens: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", estimate_text_tokens(self.summary))


ContextEntry: TypeAlias = MessageEntry | CompactionEntry


def is_cut_point(entry: ContextEntry) -> bool:
    """User and assistant messages are valid cut points; a tool result never is,
    so a tool call is never separated from its result."""
    return isinstance(entry, MessageEntry) and entry.message.role != "toolResult"


def is_user_message(entry: ContextEntry) -> bool:
    return isinstance(entry, MessageEntry) and entry.message.role == "user"


def _int(raw: Mapping[str, object], key: str, default: int = 0) -> int:
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    return value


def _optional_str(raw: Mapping[str, object], key: str) -> str | None:
    value = raw.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{key!r} must be a string, got {value!r}")


def usage_from_dict(raw: Mapping[str, object]) -> Usage:
    return Usage(
        input=_int(raw, "input"),
        output=_int(raw, "output"),
        cache_read=_int(raw, "cacheRead"),
        cache_write=_int(raw, "cacheWrite"),
        total_tokens=_int(raw, "totalTokens"),
    )


_MESSAGE_FIELDS = frozenset({"role", "content", "toolCallId", "usage", "stopReason"})


def message_from_dict(raw: Mapping[str, object]) -> Message:
    """Parse `{role, content, toolCallId?, usage?, stopReason?}`."""
    role = raw.get("role")
    if role not in ROLES:
        raise ValueError(f"unknown message role {role!r}; expected one of {ROLES}")
    usage_raw = raw.get("usage")
    if usage_raw is not None and not isinstance(usage_raw, Mapping):
        raise ValueError(f"'usage' must be an object, got {usage_raw!r}")
    return Message(
        role=role,
        content=content_from_json(raw.get("content", "")),
        tool_call_id=_optional_str(raw, "toolCallId"),
        usage=usage_from_dict(usage_raw) if usage_raw is not None else None,
        stop_reason=_optional_str(raw, "stopReason"),
        extra=unmodelled_fields(raw, _MESSAGE_FIELDS),
    )


def entry_from_dict(raw: Mapping[str, object], position: int) -> ContextEntry:
    """Parse the entry found at `position` of its list (needed to check
    that a compaction only points backwards)."""
    kind = raw.get("type")
    seq = raw.get("seq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool)):
        raise ValueError(f"'seq' must be an integer, got {seq!r}")
    if kind == "message":
        message = raw.get("message")
        if not isinstance(message, Mapping):
            raise ValueError(f"entry {position}: 'message' must be an object")
        return MessageEntry(message_from_dict(message), seq=seq)
    if kind == "compaction":
        summary = raw.get("summary")
        if not isinstance(summary, str):
            raise ValueError(f"entry {position}: compaction 'summary' must be a string")
        first_kept = _int(raw, "firstKeptIndex", -1)
        if not 0 <= first_kept <= position:
            raise ValueError(
                f"entry {position}: firstKeptIndex {first_kept} must point at or before "
                "the compaction itself"
            )
        return CompactionEntry(summary, first_kept, seq=seq)
    raise ValueError(f"entry {position}: unknown entry type {kind!r}")


def to_entries(raw_entries: Iterable[Mapping[str, object]]) -> tuple[ContextEntry, ...]:
    """Parse context entries from their JSON shape (see the module docstring)."""
    return tuple(entry_from_dict(raw, position) for position, raw in enumerate(raw_entries))


def entry_to_dict(entry: ContextEntry) -> dict[str, object]:
    """The JSON shape of an entry (inverse of `entry_from_dict`)."""
    result: dict[str, object]
    if isinstance(entry, MessageEntry):
        result = {"type": "message", "message": entry.message.to_dict()}
    else:
        result = {
            "type": "compaction",
            "summary": entry.summary,
            "firstKeptIndex": entry.first_kept_index,
        }
    if entry.seq is not None:
        result["seq"] = entry.seq
    return result
