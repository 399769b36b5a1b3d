"""What a runner tells its watchers (the edge): token-level partials, status
changes and the marks that order them against committed facts.

Values only, with no dependencies: the edge reads and writes these without
importing the hub, the runtime or anything else of the runner. The hub
(`services.runner.hub`) keeps them in each attempt's log; its docstring says
how `Committed` and `ReplayEnd` are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

# What a session's attempt is doing, as its runner reports it (the wire's
# `SessionState`): nothing (no attempt, or one that has finished), running a
# turn, or compacting the context. The edge adds the states only it can tell
# (`edge.session_status`).
SessionState: TypeAlias = Literal["idle", "running", "compacting"]
IDLE: Final = "idle"
RUNNING: Final = "running"
COMPACTING: Final = "compacting"
SESSION_STATES: Final[tuple[SessionState, ...]] = (IDLE, RUNNING, COMPACTING)
Channel: TypeAlias = Literal["text", "thinking", "tool_call"]


@dataclass(frozen=True)
class Partial:
    generation_id: str
    channel: Channel
    text: str
    epoch: int
    attempt_id: str
    # Tool-call fragments only: which call the fragment belongs to.
    tool_call_id: str = ""
    tool_name: str = ""


@dataclass(frozen=True)
class StatusChange:
    state: SessionState
    epoch: int


@dataclass(frozen=True)
class Committed:
    """The attempt has committed (or read) the session's facts up to `seq`:
    every partial it published before then precedes this mark."""

    seq: int


@dataclass(frozen=True)
class ReplayEnd:
    """Marks where the replayed partials end and live events begin.

    `committed`: the highest seq the attempt had committed (or read) when the
    watch began, so every partial published before those facts was replayed
    (marks themselves are not replayed). None from a runner that sends no
    marks (an older one)."""

    partials: int
    committed: int | None = 0


HubEvent: TypeAlias = Partial | StatusChange | Committed
WatchEvent: TypeAlias = Partial | StatusChange | Committed | ReplayEnd
