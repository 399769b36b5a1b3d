"""Named commit points where a test can stop or drain a real runner process.

`KEEL_FAULT_POINT=<name>` (optionally `<name>@<n>` for the n-th time the
point is reached, 1-based) makes the runner print `FAULT <name>` there and,
by `KEEL_FAULT_ACTION`:
- `freeze` (the default): freeze the whole process, so the test can SIGKILL
  it at exactly that point;
- `drain`: start a handoff drain of the runtime at once (the handler the
  runtime registered with `on_drain`), so the attempt hands off at that very
  boundary, as a rolling update would have it there.
`KEEL_FAULT_INJECT=duplicate_reply` plants a bug (a final answer committed
twice under two generation ids) that `keel chaos` must catch.
Unset in production: `hit()` is then a dictionary lookup.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Callable

# In the order an attempt meets them (a point inside a step, "mid_*", lets
# a drain stop only at the boundary after it).
POINTS = (
    "after_claim",
    "after_watermark",
    "mid_stream",
    "after_assistant_commit",
    "mid_tool",
    "after_some_tool_results",
    "after_tool_results",
    "after_approval_requested",
    "mid_summary",
    "after_compaction",
    "mid_cancel",
    "after_final_answer",
    "after_final_before_finish",
)

_seen: Counter[str] = Counter()
_drain_handler: Callable[[], None] | None = None


def on_drain(handler: Callable[[], None]) -> None:
    """What `KEEL_FAULT_ACTION=drain` calls at the fault point: it must mark
    the runtime draining before it returns (the boundary check follows)."""
    global _drain_handler
    _drain_handler = handler


def injected(bug: str) -> bool:
    """Whether `KEEL_FAULT_INJECT` plants `bug` (tests of the checkers only)."""
    return bug in os.environ.get("KEEL_FAULT_INJECT", "").split(",")


def _target() -> tuple[str, int] | None:
    raw = os.environ.get("KEEL_FAULT_POINT", "")
    if not raw:
        return None
    name, _, nth = raw.partition("@")
    return name, int(nth or "1")


def hit(point: str) -> None:
    target = _target()
    if target is None or target[0] != point:
        return
    _seen[point] += 1
    if _seen[point] != target[1]:
        return
    print(f"FAULT {point}", flush=True)
    sys.stdout.flush()
    if os.environ.get("KEEL_FAULT_ACTION", "freeze") == "drain":
        if _drain_handler is not None:
            _drain_handler()
        return
    # Freeze everything (event loop, lease renewal): the test kills us here.
    while True:
        time.sleep(3600)
