"""Sessions this runner keeps between turns (sticky windows, kernel.sticky).

After an answered turn the runner asks the kernel to keep the session for
`KEEL_STICKY_MS`: with the final answer's append, which settles the lease
in the same transaction where the ledger shares the kernel's PostgreSQL
(kernel/turn_settlement.py), else with its Finish. While the window lasts
the session's next input comes here as a wake over the LeaseStream, with
the same epoch: no claim, no `epoch_started`, no Read of facts this runner
already has (the fact cache keeps them). The kernel holds the truth about
the window; what is kept here is what the runner does meanwhile:

- the session's partial hub stays open, so an edge watching its attempt
  keeps watching and sees the next turn's deltas on the same watch;
- a timer lets the session go a moment after the window is over (hub
  closed; OVERHANG_MS says why the moment);
- the window ends early when the runner drains (every kept session is
  handed back at once) or when the fact cache evicts the session's facts to
  stay within its bound (memory pressure): keeping a session whose facts
  are gone saves nothing.

An ended window needs no call to the kernel: past its end the kernel no
longer wakes this runner, and any other way in issues a new epoch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kernel import Lease

log = logging.getLogger(__name__)

# The kernel's clock ends the window (the end it granted is in its time); a
# wake it decided just before that end may reach this runner a moment later,
# or this host's clock may run a little ahead. The hold outlives the window
# by this much so that such a wake still finds the session's hub open (the
# edge watching it sees the turn's deltas). Nothing else waits on it.
OVERHANG_MS = 2_000


@dataclass
class Hold:
    lease: Lease
    until_ms: int
    timer: asyncio.TimerHandle


class StickyHolds:
    """The sessions this runner keeps, each until its window's end."""

    def __init__(self, on_over: Callable[[str], None]) -> None:
        # Called with a session's id when its hold ends without a wake.
        self._on_over = on_over
        self._holds: dict[str, Hold] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._holds

    def __len__(self) -> int:
        return len(self._holds)

    def keep(self, lease: Lease, until_ms: int) -> None:
        self.take(lease.session_id)
        loop = asyncio.get_running_loop()
        delay_s = max(0.0, (until_ms + OVERHANG_MS - time.time() * 1000) / 1000)
        timer = loop.call_later(delay_s, self._over, lease.session_id)
        self._holds[lease.session_id] = Hold(lease, until_ms, timer)

    def take(self, session_id: str) -> Lease | None:
        """Ends the hold (a wake came, or it is let go); its lease, if held."""
        hold = self._holds.pop(session_id, None)
        if hold is None:
            return None
        hold.timer.cancel()
        return hold.lease

    def take_all(self) -> list[Lease]:
        return [lease for sid in list(self._holds) if (lease := self.take(sid)) is not None]

    def _over(self, session_id: str) -> None:
        if self._holds.pop(session_id, None) is not None:
            self._on_over(session_id)
