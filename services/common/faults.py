"""Named commit points where a test can stop or drain a real runner process.

`KEEL_FAULT_POINT=<name>` (optionally `<name>@<n>` for the n-th time the
point is reached, 1-based) makes the runner print `FAULT <name>` there and,
by `KEEL_FAULT_ACTION`:
- `freeze` (the default): freeze the whole process, so the test can SIGKILL
  it at exactly that point;
- `drain`: start a handoff drain of the runtime at once (the handler the
  runtime registered with `on_drain`), so the attempt hands off at that very
  boundary, as a rolling update would have it there;
- `stop`: SIGSTOP the process right there. Resumed (SIGCONT), it goes on
  exactly where it stopped. At a point right before a write (`mid_tool`,
  `before_assistant_commit`, `before_final_answer`: no await in between),
  the same loop step creates the append's gRPC call, whose task is queued
  ahead of every timer (the lease renewal) and I/O callback the resumed loop
  then finds due: the write is sent before the runner can learn that its
  lease is gone, so a stale owner's write really reaches the ledger.
`KEEL_FAULT_TRIGGER=<path>` arms the point from a file instead, for a test
that runs several runners and cannot know which one will claim a session:
the file names the point (`<name>`), and the first process to reach it
takes the file (an atomic rename to `<path>.<pid>`), so exactly one runner
acts on it and the others, its successor included, go on.
`KEEL_FAULT_INJECT=duplicate_reply` plants a bug (a final answer committed
twice under two generation ids) that `keel chaos` must catch.
Unset in production: `hit()` is then two dictionary lookups.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable

from services.common import settings_registry as registry
from services.common.setting import read_list, read_text

# In the order an attempt meets them (a point inside a step, "mid_*", lets
# a drain stop only at the boundary after it).
POINTS = (
    "after_claim",
    "after_watermark",
    "mid_stream",
    "before_assistant_commit",
    "after_assistant_commit",
    "mid_tool",
    "after_some_tool_results",
    "after_tool_results",
    "after_approval_requested",
    "mid_summary",
    "after_compaction",
    "mid_cancel",
    "before_final_answer",
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
    return bug in read_list(os.environ, registry.KEEL_FAULT_INJECT)


def _target() -> tuple[str, int] | None:
    raw = read_text(os.environ, registry.KEEL_FAULT_POINT)
    if not raw:
        return None
    name, _, nth = raw.partition("@")
    return name, int(nth or "1")


def _taken_trigger(point: str) -> bool:
    """Whether this process just took the armed trigger file for `point`."""
    path = read_text(os.environ, registry.KEEL_FAULT_TRIGGER)
    if not path:
        return False
    try:
        with open(path) as armed:
            if armed.read().strip() != point:
                return False
        # Only one process's rename succeeds: that one acts.
        os.rename(path, f"{path}.{os.getpid()}")
    except OSError:
        return False
    return True


def hit(point: str) -> None:
    if _taken_trigger(point):
        _act(point)
        return
    target = _target()
    if target is None or target[0] != point:
        return
    _seen[point] += 1
    if _seen[point] != target[1]:
        return
    _act(point)


def _act(point: str) -> None:
    print(f"FAULT {point}", flush=True)
    sys.stdout.flush()
    action = read_text(os.environ, registry.KEEL_FAULT_ACTION)
    if action == "drain":
        if _drain_handler is not None:
            _drain_handler()
        return
    if action == "stop":
        # Returns once resumed, still inside the step that reached the
        # point: nothing else of the event loop ran in between.
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    # Freeze everything (event loop, lease renewal): the test kills us here.
    while True:
        time.sleep(3600)
