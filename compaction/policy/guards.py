"""Guards that keep compaction from looping.

The runner holds the counters (they live in its session state); these pure
rules say what to do with them.
"""

from __future__ import annotations

import re
from enum import Enum

# A provider overflow is answered by one compact-and-retry; a second overflow
# in a row means compaction cannot make the request fit, so the attempt fails
# instead of compacting forever.
MAX_OVERFLOW_RETRIES = 1
# After this many consecutive failed compactions the session stops trying
# (and says so in an event) until something changes.
MAX_CONSECUTIVE_COMPACTION_FAILURES = 3


class OverflowAction(Enum):
    COMPACT_AND_RETRY = "compact_and_retry"
    FAIL = "fail"


def on_context_overflow(overflows_in_a_row: int) -> OverflowAction:
    """What to do after a context-overflow error; `overflows_in_a_row`
    counts this one (1 for the first overflow of the attempt)."""
    if overflows_in_a_row <= MAX_OVERFLOW_RETRIES:
        return OverflowAction.COMPACT_AND_RETRY
    return OverflowAction.FAIL


def compaction_suspended(consecutive_failures: int) -> bool:
    """True once compaction has failed too many times in a row."""
    return consecutive_failures >= MAX_CONSECUTIVE_COMPACTION_FAILURES


# Wordings providers use for "the prompt does not fit the context window".
_OVERFLOW_PATTERNS = re.compile(
    "|".join(
        (
            r"context[ _-]?length[ _-]?exceeded",  # OpenAI's error code
            r"maximum context length",
            r"prompt is too long",  # Anthropic
            r"exceeds? (the )?(model'?s? )?context (window|limit)",
            r"input (is )?too long",
            r"too many (input )?tokens",
        )
    ),
    re.IGNORECASE,
)


def is_context_overflow(error_message: str) -> bool:
    """Whether a provider error message reports a context overflow."""
    return _OVERFLOW_PATTERNS.search(error_message) is not None
