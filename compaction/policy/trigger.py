"""When to compact: settings, the context window, and the context's size."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

from compaction.policy.context import context_indices, latest_compaction_index
from compaction.policy.entries import ContextEntry, MessageEntry

DEFAULT_RESERVE_TOKENS = 16384
DEFAULT_KEEP_RECENT_TOKENS = 20000


@dataclass(frozen=True, slots=True)
class CompactionSettings:
    """A tenant's compaction settings (loadout `compaction.*`).

    `threshold`, when set, replaces `window - reserve_tokens` as the limit: a
    value ≤ 1 is a fraction of the window, a larger one a token count.
    `reserve_tokens` also sizes the summary's output budget (see prompts.py).
    """

    enabled: bool = True
    reserve_tokens: int = DEFAULT_RESERVE_TOKENS
    keep_recent_tokens: int = DEFAULT_KEEP_RECENT_TOKENS
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.reserve_tokens < 0:
            raise ValueError(f"reserveTokens must be ≥ 0, got {self.reserve_tokens}")
        if self.keep_recent_tokens < 0:
            raise ValueError(f"keepRecentTokens must be ≥ 0, got {self.keep_recent_tokens}")
        if self.threshold is not None and not (
            math.isfinite(self.threshold) and self.threshold >= 0
        ):
            raise ValueError(f"threshold must be a finite number ≥ 0, got {self.threshold}")


def _bool_setting(raw: Mapping[str, object], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"compaction.{key} must be a boolean, got {value!r}")
    return value


def _int_setting(raw: Mapping[str, object], key: str, default: int) -> int:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"compaction.{key} must be an integer, got {value!r}")
    return value


def settings_from_dict(raw: Mapping[str, object] | None) -> CompactionSettings:
    """Parse `{enabled?, reserveTokens?, keepRecentTokens?, threshold?}`;
    missing (or null) keys take the defaults."""
    raw = raw or {}
    threshold = raw.get("threshold")
    if threshold is not None and (
        not isinstance(threshold, int | float) or isinstance(threshold, bool)
    ):
        raise ValueError(f"compaction.threshold must be a number, got {threshold!r}")
    return CompactionSettings(
        enabled=_bool_setting(raw, "enabled", True),
        reserve_tokens=_int_setting(raw, "reserveTokens", DEFAULT_RESERVE_TOKENS),
        keep_recent_tokens=_int_setting(raw, "keepRecentTokens", DEFAULT_KEEP_RECENT_TOKENS),
        threshold=float(threshold) if threshold is not None else None,
    )


def resolve_context_window(model_context_window: int | None, tenant_default_window: int) -> int:
    """The model's declared window wins over the tenant default."""
    if model_context_window is not None and model_context_window > 0:
        return model_context_window
    return tenant_default_window


def compaction_limit(context_window: int, settings: CompactionSettings) -> int:
    """The largest context (in tokens) that does not trigger a compaction."""
    threshold = settings.threshold
    if threshold is None:
        return context_window - settings.reserve_tokens
    if threshold <= 1:
        # Multiply by the decimal the tenant wrote, not its binary float:
        # 0.29 * 100000 must be 29000, not 28999.999999999996. Contexts are
        # whole tokens, so flooring the limit leaves `>` unchanged.
        return math.floor(Decimal(repr(threshold)) * context_window)
    return math.floor(threshold)


def should_compact(context_tokens: int, context_window: int, settings: CompactionSettings) -> bool:
    """True when the context has grown past the limit (strictly)."""
    return settings.enabled and context_tokens > compaction_limit(context_window, settings)


def estimate_context_tokens(entries: Sequence[ContextEntry]) -> int:
    """The size of the context the next request presents.

    The provider's usage figure of the last completed assistant message, plus
    the estimates of everything presented after it; all estimates when there
    is no such figure. Only a figure reported after the latest compaction is
    used (stale guard): an older one measured the context before it was
    compacted and would trigger a compaction again right away.
    """
    latest = latest_compaction_index(entries)
    trailing_estimate = 0
    for position in reversed(context_indices(entries)):
        entry = entries[position]
        if position > latest and isinstance(entry, MessageEntry):
            reported = entry.message.reported_context_tokens
            if reported is not None:
                return reported + trailing_estimate
        trailing_estimate += entry.tokens
    return trailing_estimate
