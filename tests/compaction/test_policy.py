"""Unit tests of the compaction policy: COMPACTION.md's examples and rules."""

from __future__ import annotations

import pytest

from compaction.policy import (
    SUMMARY_INTRO,
    CompactionEntry,
    CompactionSettings,
    ContextEntry,
    CutPoint,
    ImageBlock,
    Message,
    MessageEntry,
    OverflowAction,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    Usage,
    assemble_summary,
    build_context,
    compaction_limit,
    compaction_suspended,
    context_indices,
    entry_to_dict,
    estimate_context_tokens,
    estimate_text_tokens,
    find_cut_point,
    is_context_overflow,
    message_from_dict,
    on_context_overflow,
    plan_compaction,
    plan_summary,
    prepare,
    resolve_context_window,
    serialize_conversation,
    settings_from_dict,
    should_compact,
    to_entries,
    tokens_after,
    would_reduce,
)
from compaction.policy.serialize import truncate_tool_result
from compaction.policy.tokens import compact_json, utf16_length


def user(tokens: int) -> MessageEntry:
    return MessageEntry(Message("user", "u" * (4 * tokens)))


def assistant(
    tokens: int, usage: Usage | None = None, stop_reason: str | None = None
) -> MessageEntry:
    content = (TextBlock("a" * (4 * tokens)),)
    return MessageEntry(Message("assistant", content, usage=usage, stop_reason=stop_reason))


def tool_result(tokens: int) -> MessageEntry:
    return MessageEntry(Message("toolResult", "r" * (4 * tokens), tool_call_id="c"))


def compaction(summary_tokens: int, first_kept_index: int) -> CompactionEntry:
    return CompactionEntry("s" * (4 * summary_tokens), first_kept_index)


# --- token estimates -------------------------------------------------------


def test_emoji_counts_as_two_utf16_code_units() -> None:
    assert utf16_length("🙂") == 2
    assert utf16_length("naïve") == 5  # BMP characters are one unit
    assert estimate_text_tokens("abc🙂") == 2  # 5 units → ceil(5/4)
    assert estimate_text_tokens("🙂🙂") == 1  # 4 units


def test_message_estimates_by_role() -> None:
    image = ImageBlock("AAAA", "image/png")
    assert Message("user", (TextBlock("hey"), image)).tokens == 1201  # 3 + 4800 chars
    assert Message("toolResult", (image,), tool_call_id="c").tokens == 1200
    call = ToolCallBlock("c1", "read", {"z": 1, "a": "two"})
    thinking_text_call = (ThinkingBlock("consider 🙂"), TextBlock("answer"), call)
    assert Message("assistant", thinking_text_call).tokens == 10  # 11 + 6 + 4 + 17 chars
    # An image in an assistant message and thinking in a user message weigh nothing.
    assert Message("assistant", (image,)).tokens == 0
    assert Message("user", (ThinkingBlock("x" * 40),)).tokens == 0


def test_tool_call_arguments_are_compact_json_with_non_ascii_kept() -> None:
    assert compact_json({"q": "naïve café", "n": [1, 2]}) == '{"q":"naïve café","n":[1,2]}'
    # Numbers as JavaScript writes them (pi measures with JSON.stringify).
    assert compact_json({"x": 1.0, "y": 1.5}) == '{"x":1,"y":1.5}'
    assert compact_json([1e-7, 0.00001, 1e21, 1e20, -2.5e-10]) == (
        "[1e-7,0.00001,1e+21,100000000000000000000,-2.5e-10]"
    )
    assert compact_json({"t": True, "n": None, "f": float("nan")}) == '{"t":true,"n":null,"f":null}'


# --- when to compact -------------------------------------------------------


def test_limit_is_window_minus_reserve() -> None:
    settings = CompactionSettings(reserve_tokens=10000)
    assert should_compact(90001, 100000, settings)
    assert not should_compact(90000, 100000, settings)


def test_defaults() -> None:
    settings = CompactionSettings()
    assert (settings.enabled, settings.reserve_tokens, settings.keep_recent_tokens) == (
        True,
        16384,
        20000,
    )
    assert settings.threshold is None
    assert settings_from_dict({}) == settings
    assert settings_from_dict(None) == settings


def test_disabled_never_compacts() -> None:
    assert not should_compact(10**9, 100000, CompactionSettings(enabled=False))


def test_threshold_at_most_one_is_a_fraction_of_the_window() -> None:
    fraction = CompactionSettings(threshold=0.8)
    assert compaction_limit(100000, fraction) == 80000
    assert not should_compact(80000, 100000, fraction)
    assert should_compact(80001, 100000, fraction)
    # The decimal the tenant wrote, not the nearest binary float.
    assert compaction_limit(100000, CompactionSettings(threshold=0.29)) == 29000
    assert compaction_limit(100000, CompactionSettings(threshold=1)) == 100000


def test_threshold_above_one_is_a_token_count() -> None:
    absolute = settings_from_dict({"threshold": 5000})
    assert compaction_limit(100000, absolute) == 5000
    assert not should_compact(5000, 100000, absolute)
    assert should_compact(5001, 100000, absolute)


def test_threshold_overrides_reserve() -> None:
    settings = CompactionSettings(reserve_tokens=50000, threshold=0.9)
    assert compaction_limit(100000, settings) == 90000


def test_model_window_wins_over_tenant_default() -> None:
    assert resolve_context_window(200000, 128000) == 200000
    assert resolve_context_window(None, 128000) == 128000
    assert resolve_context_window(0, 128000) == 128000


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="enabled"):
        settings_from_dict({"enabled": "yes"})
    with pytest.raises(ValueError, match="keepRecentTokens"):
        settings_from_dict({"keepRecentTokens": 1.5})
    with pytest.raises(ValueError, match="threshold"):
        CompactionSettings(threshold=-0.5)


def test_context_tokens_without_usage_are_all_estimates() -> None:
    entries = [user(10), assistant(20), user(5)]
    assert estimate_context_tokens(entries) == 35


def test_context_tokens_use_last_usage_plus_trailing_estimates() -> None:
    entries = [user(10), assistant(20, Usage(input=900, output=100)), user(5), tool_result(7)]
    assert estimate_context_tokens(entries) == 1000 + 5 + 7
    with_total = [user(10), assistant(20, Usage(input=1, total_tokens=5000)), user(5)]
    assert estimate_context_tokens(with_total) == 5005


def test_zero_usage_counts_as_none() -> None:
    earlier = assistant(20, Usage(input=900, output=100))
    entries = [user(10), earlier, user(5), assistant(3, Usage()), user(1)]
    # The zero figure is skipped: the earlier figure plus estimates after it.
    assert estimate_context_tokens(entries) == 1000 + 5 + 3 + 1
    assert estimate_context_tokens([user(10), assistant(3, Usage())]) == 13


def test_usage_of_failed_responses_is_ignored() -> None:
    for stop_reason in ("error", "aborted"):
        failed = assistant(3, Usage(input=10**6), stop_reason=stop_reason)
        assert estimate_context_tokens([user(10), failed]) == 13


def test_stale_usage_older_than_latest_compaction_never_triggers() -> None:
    # The kept assistant reported a huge context before the compaction shrank it.
    big_usage = Usage(input=95000)
    entries: list[ContextEntry] = [
        user(10),
        assistant(10),
        user(10),
        assistant(10, big_usage),
        compaction(5, 2),
        user(10),
    ]
    assert estimate_context_tokens(entries) == 5 + 10 + 10 + 10
    plan = plan_compaction(entries, CompactionSettings(reserve_tokens=10000), 100000)
    assert not plan.should_compact
    # A figure reported after the compaction is used again.
    entries.append(assistant(2, Usage(input=95000)))
    assert estimate_context_tokens(entries) == 95000
    assert plan_compaction(entries, CompactionSettings(reserve_tokens=10000), 100000).should_compact


# --- cut point: COMPACTION.md's example table ------------------------------


@pytest.mark.parametrize(
    ("entries", "keep", "expected"),
    [
        ([user(10), assistant(10), user(10), assistant(10)], 20, CutPoint(2, -1, False)),
        ([user(10), assistant(10), user(10), assistant(10)], 21, CutPoint(1, 0, True)),
        ([user(160), assistant(120), tool_result(100), assistant(140)], 130, CutPoint(3, 0, True)),
        (
            [user(100), assistant(100), user(100), assistant(5), *[tool_result(10000)] * 2],
            15000,
            CutPoint(3, 2, True),
        ),
        ([user(1), assistant(1), user(1), assistant(1)], 10**6, CutPoint(0, -1, False)),
    ],
    ids=["boundary-20", "boundary-21", "split-large-turn", "issue-7201", "everything-fits"],
)
def test_cut_point_examples(entries: list[ContextEntry], keep: int, expected: CutPoint) -> None:
    assert find_cut_point(entries, 0, len(entries), keep) == expected


def test_trailing_tool_results_still_compact_unlike_pi_7201() -> None:
    # Pi would fall back to its first cut point (index 0) and keep everything.
    entries = [user(100), assistant(100), user(100), assistant(5), tool_result(10000)]
    entries.append(tool_result(10000))
    preparation = prepare(entries, CompactionSettings(keep_recent_tokens=15000))
    assert preparation is not None
    assert preparation.summarize_indices == (0, 1)
    assert preparation.prefix_indices == (2,)


def test_only_tool_results_keep_the_whole_range() -> None:
    entries = [tool_result(5), tool_result(5)]
    assert find_cut_point(entries, 0, 2, 1) == CutPoint(0, -1, False)


def test_zero_token_entries_never_decide_the_cut() -> None:
    entries = [user(5), assistant(5), user(0), assistant(0)]
    # With keep 0 the first non-empty entry from the end (1) decides.
    assert find_cut_point(entries, 0, 4, 0) == CutPoint(1, 0, True)


def test_cut_range_is_checked() -> None:
    with pytest.raises(ValueError):
        find_cut_point([user(1)], 0, 2, 1)


# --- preparing a compaction ------------------------------------------------


def test_nothing_to_do_right_after_a_compaction() -> None:
    entries: list[ContextEntry] = [user(50), assistant(50), user(50), assistant(50)]
    entries.append(compaction(1, 2))
    assert prepare(entries, CompactionSettings(keep_recent_tokens=10)) is None


def test_range_starts_at_previous_first_kept_issue_2608() -> None:
    entries: list[ContextEntry] = [user(50), assistant(50), user(50), assistant(50)]
    entries += [compaction(3, 2), user(50), assistant(50)]
    preparation = prepare(entries, CompactionSettings(keep_recent_tokens=100))
    assert preparation is not None
    # Pi would summarize nothing before index 5 and lose 2 and 3.
    assert preparation.summarize_indices == (2, 3)
    assert preparation.first_kept_index == 5
    assert preparation.previous_summary == "s" * 12
    assert preparation.tokens_before == 3 + 4 * 50


def test_split_turn_alone_carries_previous_summary_forward() -> None:
    entries: list[ContextEntry] = [user(20), assistant(20), user(200), assistant(10)]
    entries += [tool_result(100), compaction(1, 2), assistant(150)]
    settings = CompactionSettings(keep_recent_tokens=150)
    preparation = prepare(entries, settings)
    assert preparation is not None
    assert (preparation.summarize_indices, preparation.prefix_indices) == ((), (2, 3, 4))
    assert preparation.previous_summary == "ssss"

    summary_plan = plan_summary(preparation, settings)
    assert summary_plan.history_request is None
    assert summary_plan.carried_summary == "ssss"
    assert summary_plan.turn_prefix_request is not None
    merged = assemble_summary(summary_plan, None, "prefix summary")
    assert merged.startswith("ssss\n\n")
    assert "Turn Context (split turn)" in merged
    assert merged.endswith("prefix summary")


def test_compaction_that_would_not_reduce_is_detected() -> None:
    entries = [user(100), assistant(100), user(10), assistant(10)]
    preparation = prepare(entries, CompactionSettings(keep_recent_tokens=20))
    assert preparation is not None
    assert preparation.tokens_before == 220
    assert preparation.tokens_kept == 20
    assert would_reduce(preparation, "short summary")
    assert tokens_after(preparation, "x" * 800) == 220
    assert not would_reduce(preparation, "x" * 800)


# --- the next request ------------------------------------------------------


def test_context_presents_summary_then_kept_then_newer() -> None:
    kept_and_newer = [user(1), assistant(1), user(1)]
    entries: list[ContextEntry] = [user(1), assistant(1), *kept_and_newer[:2]]
    entries += [compaction(1, 2), kept_and_newer[2]]
    assert context_indices(entries) == (4, 2, 3, 5)
    messages = build_context(entries)
    assert messages[0].role == "user"
    assert messages[0].content == (
        "The conversation history before this point was compacted into the following "
        "summary:\n\n<summary>\nssss\n</summary>"
    )
    assert messages[0].content.startswith(SUMMARY_INTRO)
    assert messages[1:] == tuple(entry.message for entry in kept_and_newer)


def test_only_latest_compaction_counts() -> None:
    entries: list[ContextEntry] = [user(1), assistant(1), compaction(1, 0), user(1)]
    entries += [assistant(1), compaction(1, 3), user(1)]
    assert context_indices(entries) == (5, 3, 4, 6)


# --- summary prompt --------------------------------------------------------


def test_serialization_labels_and_drops_images() -> None:
    call = ToolCallBlock("c1", "read", {"path": "/a", "limit": 10})
    messages = [
        Message("user", (TextBlock("fix it"), ImageBlock("AAAA", "image/png"))),
        Message("assistant", (ThinkingBlock("hmm"), TextBlock("on it"), call)),
        Message("toolResult", "contents", tool_call_id="c1"),
        Message("toolResult", (ImageBlock("AAAA", "image/png"),), tool_call_id="c2"),
    ]
    assert serialize_conversation(messages) == (
        "[User]: fix it\n\n"
        "[Assistant thinking]: hmm\n\n"
        "[Assistant]: on it\n\n"
        '[Assistant tool calls]: read(path="/a", limit=10)\n\n'
        "[Tool result]: contents"
    )


def test_tool_results_are_cut_at_2000_chars() -> None:
    text = "x" * 2500
    serialized = serialize_conversation([Message("toolResult", text, tool_call_id="c")])
    assert serialized == "[Tool result]: " + "x" * 2000 + "\n\n[... 500 more characters truncated]"
    assert truncate_tool_result("y" * 2000) == "y" * 2000
    # The cut never splits an emoji; counts are UTF-16 code units.
    emoji_text = "x" * 1999 + "🙂" + "z"
    assert truncate_tool_result(emoji_text) == "x" * 1999 + "\n\n[... 3 more characters truncated]"


def test_summary_prompts_and_budgets() -> None:
    settings = CompactionSettings(reserve_tokens=10000, keep_recent_tokens=20)
    entries = [user(100), assistant(100), user(100), assistant(10), tool_result(10), assistant(20)]
    preparation = prepare(entries, settings)
    assert preparation is not None and preparation.is_split_turn
    summary_plan = plan_summary(preparation, settings, focus="the database schema")
    history = summary_plan.history_request
    prefix = summary_plan.turn_prefix_request
    assert history is not None and prefix is not None
    assert history.max_output_tokens == 8000
    assert prefix.max_output_tokens == 5000
    for heading in (
        "Goal",
        "Constraints & Preferences",
        "Progress",
        "Done",
        "In Progress",
        "Blocked",
        "Key Decisions",
        "Next Steps",
        "Critical Context",
    ):
        assert heading in history.prompt
    assert "<previous-summary>" not in history.prompt
    assert "the database schema" in history.prompt
    for heading in ("Original Request", "Early Progress", "Context for Suffix"):
        assert heading in prefix.prompt
    assert "[User]: " + "u" * 400 in history.prompt
    assert "[User]: " + "u" * 400 in prefix.prompt

    merged = assemble_summary(summary_plan, "HISTORY", "PREFIX")
    assert merged.index("HISTORY") < merged.index("Turn Context (split turn)")
    assert merged.index("Turn Context (split turn)") < merged.index("PREFIX")
    with pytest.raises(ValueError):
        assemble_summary(summary_plan, None, "PREFIX")


def test_update_prompt_when_previous_summary_exists() -> None:
    entries: list[ContextEntry] = [user(50), assistant(50), compaction(2, 0), user(50)]
    entries.append(assistant(50))
    preparation = prepare(entries, CompactionSettings(keep_recent_tokens=100))
    assert preparation is not None
    history = plan_summary(preparation, CompactionSettings()).history_request
    assert history is not None
    assert "<previous-summary>\nssssssss\n</previous-summary>" in history.prompt
    assert "Update the checkpoint" in history.prompt


# --- guards ----------------------------------------------------------------


def test_overflow_retries_once_then_fails() -> None:
    assert on_context_overflow(1) is OverflowAction.COMPACT_AND_RETRY
    assert on_context_overflow(2) is OverflowAction.FAIL


def test_three_failed_compactions_suspend() -> None:
    assert not compaction_suspended(2)
    assert compaction_suspended(3)


def test_overflow_error_messages() -> None:
    assert is_context_overflow("This model's maximum context length is 128000 tokens.")
    assert is_context_overflow("prompt is too long: 210000 tokens > 200000 maximum")
    assert is_context_overflow("Error code: 400 - {'code': 'context_length_exceeded'}")
    assert not is_context_overflow("rate limit exceeded")


# --- parsing ---------------------------------------------------------------


def test_entries_round_trip_through_json_shape() -> None:
    thinking = {"type": "thinking", "thinking": "hm", "thinkingSignature": "sig"}
    call = {"type": "toolCall", "id": "c1", "name": "read", "arguments": {"p": 1.5}}
    result = {"role": "toolResult", "toolCallId": "c1", "toolName": "read", "content": "ok"}
    raw: list[dict[str, object]] = [
        {"type": "message", "message": {"role": "user", "content": "hi"}, "seq": 7},
        {"type": "message", "message": {"role": "assistant", "content": [thinking, call]}},
        {"type": "message", "message": result},
        {"type": "compaction", "summary": "s", "firstKeptIndex": 0, "seq": 9},
    ]
    entries = to_entries(raw)
    assert entries[0].seq == 7
    # Fields the policy does not model (signatures, toolName) survive.
    assert [entry_to_dict(entry) for entry in entries] == raw
    message = message_from_dict(
        {"role": "assistant", "content": [], "usage": {"input": 3, "cacheRead": 4}}
    )
    assert message.usage == Usage(input=3, cache_read=4)


@pytest.mark.parametrize(
    "raw",
    [
        [{"type": "message", "message": {"role": "system", "content": "x"}}],
        [{"type": "compaction", "summary": "s", "firstKeptIndex": 1}],
        [{"type": "watermark"}],
        [{"type": "message", "message": {"role": "user", "content": [{"type": "audio"}]}}],
    ],
    ids=["unknown-role", "compaction-points-forward", "unknown-entry", "unknown-block"],
)
def test_invalid_entries_are_rejected(raw: list[dict[str, object]]) -> None:
    with pytest.raises(ValueError):
        to_entries(raw)
