"""Parsing a session's context once: the runner's memo never changes what a
request presents, whatever the facts that arrive after a message was parsed."""

from __future__ import annotations

from typing import Any

from compaction.policy import message_from_dict
from compaction.transcript import (
    messages_of,
    parsed_context,
    presented_request,
    request_messages,
)
from services.ledger.facts import CommittedFact
from services.runner import transcript as T


def _session() -> list[CommittedFact]:
    """Inputs, a tool round trip with an input arriving mid-call (presented
    after the result), a cancelled exchange and a compaction."""
    specs: list[tuple[str, dict[str, Any]]] = [
        ("session_created", {"tenantId": "t"}),
        ("input", {"text": "first", "requestId": "r1"}),
        ("epoch_started", {"epoch": 1, "watermark": 2}),
        (
            "assistant",
            {
                "generationId": "gen-2",
                "content": [{"type": "text", "text": "calling"}],
                "toolCalls": [{"id": "c1", "name": "clock", "arguments": {}}],
                "usage": {"input": 10, "output": 3, "totalTokens": 13},
                "stopReason": "toolUse",
            },
        ),
        ("input", {"text": "while the tool runs", "requestId": "r2"}),
        ("tool_result", {"toolCallId": "c1", "content": "12:00", "isError": False}),
        (
            "assistant",
            {
                "generationId": "gen-6",
                "content": [{"type": "text", "text": "it is noon"}],
                "toolCalls": [],
                "stopReason": "stop",
                "inputSeqs": [2, 5],
            },
        ),
        ("input", {"text": "never mind", "requestId": "r3"}),
        ("cancelled", {}),
        (
            "assistant",
            {
                "generationId": "cancel-9",
                "content": [],
                "toolCalls": [],
                "stopReason": "cancelled",
                "inputSeqs": [8],
            },
        ),
        ("compaction", {"summary": "we talked about the time", "firstKept": 7}),
        ("input", {"text": "after the summary", "requestId": "r4"}),
    ]
    return [CommittedFact("s", seq, kind, data, 0, 1) for seq, (kind, data) in enumerate(specs, 1)]


def test_memoized_parse_presents_exactly_the_fresh_parse() -> None:
    facts = _session()
    memo: dict[int, Any] = {}
    for head in range(1, len(facts) + 1):
        prefix = facts[:head]
        for watermark in (None, head, max(head - 1, 0)):
            memoized = T.windowed_context(prefix, watermark, memo)
            assert memoized == T.windowed_context(prefix, watermark)
            assert messages_of(memoized) == request_messages(prefix, watermark)
    assert memo, "message entries were remembered"


def test_a_remembered_message_is_not_parsed_again() -> None:
    facts = _session()
    memo: dict[int, Any] = {}
    first = T.windowed_context(facts, None, memo)
    again = T.windowed_context(facts, None, memo)
    assert all(a is b for a, b in zip(first, again, strict=True) if a.seq in memo)
    assert any(entry.seq not in memo for entry in again), "compactions are parsed afresh"


def test_the_presented_estimate_is_the_estimate_of_the_messages_sent() -> None:
    """The runner hands providers its token estimate instead of having them
    re-parse the request: it must be what re-parsing would give."""
    facts = _session()
    for head in range(1, len(facts) + 1):
        messages, tokens = presented_request(parsed_context(facts[:head]))
        assert tokens == sum(message_from_dict(m).tokens for m in messages)
