"""Checks that a model request is a well-formed conversation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from compaction.policy.context import SUMMARY_INTRO


def check_well_formed(messages: Sequence[Mapping[str, Any]]) -> None:
    """Tool results directly follow the answer that called them, one per
    call, and the request does not end with an answer."""
    assert messages, "a request presents at least one message"
    assert messages[-1]["role"] != "assistant", "a request never ends with an answer"
    expected_results: list[str] = []
    for message in messages:
        role = message["role"]
        if expected_results:
            assert role == "toolResult", f"{role} between a tool call and its result"
            assert message["toolCallId"] == expected_results.pop(0)
            continue
        assert role != "toolResult", "a tool result without its call"
        if role == "assistant":
            expected_results = [
                block["id"] for block in message["content"] if block.get("type") == "toolCall"
            ]
    assert not expected_results, "a tool call without its result"


def user_text(message: Mapping[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if block.get("type") == "text")


def is_summary(message: Mapping[str, Any]) -> bool:
    return message["role"] == "user" and user_text(message).startswith(SUMMARY_INTRO)


def trailing_inputs(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The user messages since the last completed answer (an answer without
    tool calls), compaction summaries left out: what the next final answer
    answers."""
    since: list[str] = []
    for message in messages:
        if message["role"] == "user":
            if not is_summary(message):
                since.append(user_text(message))
        elif message["role"] == "assistant" and not any(
            block.get("type") == "toolCall" for block in message["content"]
        ):
            since = []
    return since
