"""Named commit points where a crash test can stop a real runner process.

`KEEL_FAULT_POINT=<name>` (optionally `<name>@<n>` for the n-th time the
point is reached, 1-based) makes the runner print `FAULT <name>` and freeze
the whole process there, so the test can SIGKILL it at exactly that point.
Unset in production: `hit()` is then a dictionary lookup.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

POINTS = (
    "after_watermark",
    "mid_stream",
    "after_assistant_commit",
    "mid_tool",
    "after_some_tool_results",
    "after_final_before_finish",
    "mid_summary",
)

_seen: Counter[str] = Counter()


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
    # Freeze everything (event loop, lease renewal): the test kills us here.
    while True:
        time.sleep(3600)
