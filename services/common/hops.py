"""Hops and commits of the hot path, counted so a regression shows.

A turn's cost is mostly what it pays per hop (an RPC, or one message on a
long-lived stream) and per database commit. Every server counts the RPCs it
receives, every stream servicer each message it handles, every store each
transaction it commits; `keel bench turns` and tests/test_turn_hops.py
divide the difference by the turns run. The counters are per process: a
benchmark or test that wants a whole turn runs every service in one.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

_lock = threading.Lock()
_calls: Counter[str] = Counter()
_commits: Counter[str] = Counter()


def called(method: str, count: int = 1) -> None:
    """One RPC received, or one request handled on a stream (`method` names
    it, e.g. `keel.ledger.v1.LedgerService/Append`)."""
    with _lock:
        _calls[method] += count


def committed(store: str, count: int = 1) -> None:
    """One database transaction that wrote, by the store that ran it."""
    with _lock:
        _commits[store] += count


@dataclass(frozen=True)
class Hops:
    calls: dict[str, int] = field(default_factory=dict)
    commits: dict[str, int] = field(default_factory=dict)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_commits(self) -> int:
        return sum(self.commits.values())

    def since(self, earlier: Hops) -> Hops:
        """What was counted between `earlier` and this snapshot."""
        return Hops(
            calls=_minus(self.calls, earlier.calls),
            commits=_minus(self.commits, earlier.commits),
        )


def _minus(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def snapshot() -> Hops:
    with _lock:
        return Hops(calls=dict(_calls), commits=dict(_commits))
