"""Transcript → plain text for the summarizing model.

The transcript is sent as text, not as chat messages, so the summarizer reads
it as material to condense rather than a conversation to continue. Images
are dropped (a summary cannot carry them); long tool results are cut because
their gist, not their bulk, belongs in a summary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from compaction.policy.blocks import TextBlock, ThinkingBlock, ToolCallBlock
from compaction.policy.entries import Message
from compaction.policy.tokens import compact_json, utf16_length

TOOL_RESULT_MAX_CHARS = 2000


def truncate_tool_result(text: str, max_chars: int = TOOL_RESULT_MAX_CHARS) -> str:
    """Keep the first `max_chars` (UTF-16 code units) and say how many were cut.

    The cut never splits a surrogate pair; the count is in the same units.
    """
    total = utf16_length(text)
    if total <= max_chars:
        return text
    if text.isascii():
        kept = text[:max_chars]
    else:
        units = 0
        end = 0
        for char in text:
            width = 2 if ord(char) >= 0x10000 else 1
            if units + width > max_chars:
                break
            units += width
            end += 1
        kept = text[:end]
    omitted = total - utf16_length(kept)
    return f"{kept}\n\n[... {omitted} more characters truncated]"


def format_tool_call(call: ToolCallBlock) -> str:
    """`name(key=json, …)`; arguments that are not an object are shown whole."""
    arguments = call.arguments
    if isinstance(arguments, Mapping):
        rendered = ", ".join(f"{key}={compact_json(value)}" for key, value in arguments.items())
    else:
        rendered = compact_json(arguments)
    return f"{call.name}({rendered})"


def _joined_text(message: Message) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(block.text for block in message.content if isinstance(block, TextBlock))


def serialize_message(message: Message) -> list[str]:
    """The labelled paragraphs one message contributes (none if it is empty)."""
    if message.role == "user":
        text = _joined_text(message)
        return [f"[User]: {text}"] if text else []
    if message.role == "toolResult":
        text = _joined_text(message)
        return [f"[Tool result]: {truncate_tool_result(text)}"] if text else []

    content = message.content
    if isinstance(content, str):
        return [f"[Assistant]: {content}"] if content else []
    thinking = [block.thinking for block in content if isinstance(block, ThinkingBlock)]
    texts = [block.text for block in content if isinstance(block, TextBlock)]
    calls = [format_tool_call(block) for block in content if isinstance(block, ToolCallBlock)]
    paragraphs: list[str] = []
    if thinking:
        paragraphs.append("[Assistant thinking]: " + "\n".join(thinking))
    if texts:
        paragraphs.append("[Assistant]: " + "\n".join(texts))
    if calls:
        paragraphs.append("[Assistant tool calls]: " + "; ".join(calls))
    return paragraphs


def serialize_conversation(messages: Iterable[Message]) -> str:
    """All messages as labelled paragraphs separated by blank lines."""
    paragraphs: list[str] = []
    for message in messages:
        paragraphs.extend(serialize_message(message))
    return "\n\n".join(paragraphs)
