"""Logging an outage of something a retry loop depends on, quietly.

A loop that retries every half second while its kernel or database is away
would log a line (and a traceback) per attempt: hundreds of lines for a
short outage, drowning what happened before it. `OutageLog` says instead:

- once, when the dependency goes away (the first failed attempt, with its
  error);
- every `summary_every_s` while it stays away, how long it has been away
  and how many attempts failed;
- once, when it is back (the first attempt that succeeds), with the same
  totals.

An expected outage (a `ServiceUnavailable`: the service or its database
cannot answer now) is logged without a traceback; the caller keeps logging
an unexpected exception with its traceback, since that is a bug.
Thread-safe: a loop on a worker thread and one on the event loop may share
one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

# How often a lasting outage is summed up.
SUMMARY_EVERY_S = 30.0


class OutageLog:
    """The outage of one dependency, as a retry loop sees it: call
    `failed(error)` after each attempt that failed because the dependency
    is away, `succeeded()` after each one that worked."""

    def __init__(
        self,
        log: logging.Logger,
        dependency: str,
        *,
        attempts: str = "attempts failed",
        summary_every_s: float = SUMMARY_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        # Said in every line: "kernel", "PostgreSQL", "the ledger".
        self.dependency = dependency
        # What is counted, after the count: "claims failed", "requests refused".
        self._attempts = attempts
        self._summary_every_s = summary_every_s
        self._clock = clock
        self._lock = threading.Lock()
        # When the outage began (None: no outage), and since the last line.
        self._since: float | None = None
        self._said_at = 0.0
        self._failures = 0

    @property
    def away(self) -> bool:
        """Whether the last attempt failed (an outage is going on)."""
        return self._since is not None

    @property
    def failures(self) -> int:
        """Attempts failed in the outage going on (0: none)."""
        return self._failures

    def failed(self, error: object) -> None:
        """One attempt failed because the dependency is away; `error` (an
        exception or a message) is said only in the outage's first line."""
        args: tuple[object, ...]
        with self._lock:
            now = self._clock()
            self._failures += 1
            if self._since is None:
                self._since = self._said_at = now
                line = "%s unreachable: %s (said again every %.0f s until it is back)"
                args = (self.dependency, error, self._summary_every_s)
            elif now - self._said_at >= self._summary_every_s:
                self._said_at = now
                line = "%s still unreachable for %.0f s; %d %s"
                args = (self.dependency, now - self._since, self._failures, self._attempts)
            else:
                return
        self._log.warning(line, *args)

    def succeeded(self) -> None:
        """One attempt worked: an outage going on is over."""
        if self._since is None:  # the common case, without the lock
            return
        with self._lock:
            if self._since is None:
                return
            away_s = self._clock() - self._since
            failures = self._failures
            self._since, self._failures = None, 0
        self._log.warning(
            "%s is back after %.0f s; %d %s meanwhile",
            self.dependency,
            away_s,
            failures,
            self._attempts,
        )


# What psycopg's pool says at WARNING about each reconnection attempt and
# each connection it finds dead: during a database outage, a line a second
# per pool and one per pooled connection (53 lines in an 11 s outage of a
# small `keel up --processes`). The services' outage logs say the same once,
# when it ends, and in between as a sum. What else the pool warns about (a
# connection returned inside a transaction: a bug) still gets through.
_POOL_RETRY_NOISE = (
    "error connecting in ",
    "reconnection attempt in pool ",
    "discarding broken connection",
    "discarding closed connection",
)


class PoolRetryFilter(logging.Filter):
    """Drops psycopg_pool's per-attempt outage warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.levelno >= logging.ERROR:
            return True
        message = str(record.msg)
        return not message.startswith(_POOL_RETRY_NOISE)


def quiet_pool_retries(level: str) -> None:
    """Filters the pool's outage warnings unless logs are at DEBUG."""
    pool_log = logging.getLogger("psycopg.pool")
    for existing in pool_log.filters:
        if isinstance(existing, PoolRetryFilter):
            pool_log.removeFilter(existing)
    if level.upper() != "DEBUG":
        pool_log.addFilter(PoolRetryFilter())
