"""Keel's compaction policy: pure functions, no I/O (rules: COMPACTION.md).

Input is the session's context entries in ledger order, parsed from their
JSON shape with `to_entries` (see `entries.py`). Indices in results are
positions in that list; callers map them back to ledger seqs (entries may
carry a `seq` for that).

Runner, before each model request:
    plan = plan_compaction(entries, settings, window)
        -> CompactionPlan(context_tokens, limit, should_compact, preparation)
    messages = build_context(entries)            # what follows the system prompt

Compaction service:
    preparation = prepare(entries, settings)     # None: nothing to compact
    summary_plan = plan_summary(preparation, settings, focus)
    ... call the model for summary_plan.history_request / .turn_prefix_request ...
    summary = assemble_summary(summary_plan, history_text, prefix_text)
    if would_reduce(preparation, summary): commit it

Building blocks:
    to_entries(raw) / entry_to_dict(entry) / message_from_dict(raw)
    settings_from_dict(raw) -> CompactionSettings
    resolve_context_window(model_window, tenant_default) -> int
    estimate_context_tokens(entries) -> int   # usage + estimates, stale-guarded
    should_compact(context_tokens, window, settings) -> bool
    find_cut_point(entries, start, end, keep_recent_tokens) -> CutPoint
    context_indices(entries) -> tuple[int, ...]
    serialize_conversation(messages) -> str
    on_context_overflow(n) / compaction_suspended(n) / is_context_overflow(text)
"""

from compaction.policy.blocks import (
    Content,
    ContentBlock,
    ImageBlock,
    Role,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from compaction.policy.context import (
    SUMMARY_INTRO,
    build_context,
    context_indices,
    estimate_presented_tokens,
    latest_compaction_index,
    summary_message,
    wrap_summary,
)
from compaction.policy.cutpoint import CutPoint, find_cut_point
from compaction.policy.entries import (
    CompactionEntry,
    ContextEntry,
    Message,
    MessageEntry,
    Usage,
    entry_from_dict,
    entry_to_dict,
    is_cut_point,
    message_from_dict,
    to_entries,
)
from compaction.policy.guards import (
    MAX_CONSECUTIVE_COMPACTION_FAILURES,
    OverflowAction,
    compaction_suspended,
    is_context_overflow,
    on_context_overflow,
)
from compaction.policy.preparation import (
    CompactionPlan,
    Preparation,
    plan_compaction,
    prepare,
    tokens_after,
    would_reduce,
)
from compaction.policy.prompts import SummaryPlan, SummaryRequest, assemble_summary, plan_summary
from compaction.policy.serialize import serialize_conversation
from compaction.policy.tokens import estimate_text_tokens
from compaction.policy.trigger import (
    CompactionSettings,
    compaction_limit,
    estimate_context_tokens,
    resolve_context_window,
    settings_from_dict,
    should_compact,
)

__all__ = [
    "MAX_CONSECUTIVE_COMPACTION_FAILURES",
    "SUMMARY_INTRO",
    "CompactionEntry",
    "CompactionPlan",
    "CompactionSettings",
    "Content",
    "ContentBlock",
    "ContextEntry",
    "CutPoint",
    "ImageBlock",
    "Message",
    "MessageEntry",
    "OverflowAction",
    "Preparation",
    "Role",
    "SummaryPlan",
    "SummaryRequest",
    "TextBlock",
    "ThinkingBlock",
    "ToolCallBlock",
    "Usage",
    "assemble_summary",
    "build_context",
    "compaction_limit",
    "compaction_suspended",
    "context_indices",
    "entry_from_dict",
    "entry_to_dict",
    "estimate_context_tokens",
    "estimate_presented_tokens",
    "estimate_text_tokens",
    "find_cut_point",
    "is_context_overflow",
    "is_cut_point",
    "latest_compaction_index",
    "message_from_dict",
    "on_context_overflow",
    "plan_compaction",
    "plan_summary",
    "prepare",
    "resolve_context_window",
    "serialize_conversation",
    "settings_from_dict",
    "should_compact",
    "summary_message",
    "to_entries",
    "tokens_after",
    "would_reduce",
    "wrap_summary",
]
