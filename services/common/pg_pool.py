"""How a service's psycopg pool rides out a PostgreSQL outage.

psycopg_pool's defaults suit a database that never goes away: a caller waits
up to 30 s for a connection, and a connection lost with the server is
re-made with exponential backoff for five minutes, so after a 45 s outage
the next attempt may be half a minute after the server is back. Here:

- a caller waits at most `CHECKOUT_TIMEOUT_S` for a connection, then gets a
  PoolTimeout its service reports as UNAVAILABLE (clients retry);
- a failing reconnection gives up after `RECONNECT_TIMEOUT_S`, so the next
  caller that needs a connection starts a fresh attempt at once: the pool
  is back within about a second of the server;
- a connection the server closed while it sat idle in the pool (a restart
  ends every session) is noticed on checkout without a round trip, and
  replaced, instead of failing the first request after the outage.

`OutageGate` lets a service refuse at once while its database is known to
be away, instead of making every caller wait out a pool timeout.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from services.common.errors import DatabaseUnavailable

CHECKOUT_TIMEOUT_S = 3.0
RECONNECT_TIMEOUT_S = 2.0
# How long an OutageGate refuses without asking after a failure: well under
# the Retry-After clients are given.
OUTAGE_PAUSE_S = 0.5
# The longest one probe of a closed OutageGate is waited for.
PROBE_S = 10.0
# How long `answers` waits for the server to take a connection.
PROBE_CONNECT_TIMEOUT_S = 1


def answers(url: str) -> Callable[[], None]:
    """An OutageGate probe: a new connection to `url` and `SELECT 1`, bounded
    by PROBE_CONNECT_TIMEOUT_S (outside any pool, whose waits are longer)."""

    def probe() -> None:
        with psycopg.connect(url, connect_timeout=PROBE_CONNECT_TIMEOUT_S) as conn:
            conn.execute("SELECT 1")

    return probe


def _is_dead(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection is known to be unusable, without a round trip.

    An idle connection has nothing to read unless the server spoke first:
    when it shuts down it sends a FATAL notice and closes the socket. A
    readable socket is taken as that (anything else unsolicited, such as a
    parameter change, costs one reconnect at worst).
    """
    if conn.closed or conn.broken:
        return True
    # poll, not select: a busy process's descriptors may be past FD_SETSIZE.
    poller = select.poll()
    poller.register(conn.pgconn.socket, select.POLLIN)
    return bool(poller.poll(0))


def heal_quickly(pool: ConnectionPool[Any], checkout_timeout_s: float = CHECKOUT_TIMEOUT_S) -> None:
    """Applies this module's settings to `pool` (also to one made elsewhere:
    the event store's takes no such options)."""

    def check(conn: psycopg.Connection[Any]) -> None:
        if not _is_dead(conn):
            return
        conn.close()
        # One dead connection means the server went away: every idle one is
        # dead too. Sweep them now (each fails at once on its closed socket),
        # or the pool would back off a second between discoveries.
        pool.check()
        raise psycopg.OperationalError("the server closed this idle connection")

    pool.timeout = checkout_timeout_s
    pool.reconnect_timeout = RECONNECT_TIMEOUT_S
    # No public setter, and the event store makes its pool without `check`.
    pool._check = check


class OutageGate:
    """A circuit breaker in front of the database: refuses at once while it
    is known to be away, and lets one caller at a time find out if it is back.

    A service whose every call waits out a pool timeout during an outage
    also holds its threads and locks that long: with twenty clients retrying,
    reads and appends queue behind each other for tens of seconds, when each
    answer (503, retry) is known in advance. So after a failure calls are
    refused without asking for `pause_s`; then the next caller is let through
    as the probe while every other call is still refused. The probe's success
    (`succeeded`) opens the gate for all; its failure closes it for another
    `pause_s`. Recovery costs at most `pause_s` plus one probe.
    """

    def __init__(
        self,
        what: str,
        pause_s: float = OUTAGE_PAUSE_S,
        probe: Callable[[], None] | None = None,
    ) -> None:
        self._what = what
        self._pause_s = pause_s
        # A cheap, bounded question to the database (`answers`): the probe,
        # instead of the caller's own work, which may retry for many
        # seconds inside a library while everyone else queues behind it.
        self._probe = probe
        self._lock = threading.Lock()
        # Read without the lock on the hot path (a bool read whole); set
        # under it.
        self._down = False
        self._closed_until = 0.0
        # While a probe is out, others are refused; a probe that never
        # reports back (a path that neither failed nor succeeded) stops
        # counting after PROBE_S, so the gate cannot stay shut for good.
        self._probe_until = 0.0

    def check(self) -> None:
        """Raises DatabaseUnavailable while the gate is closed; lets one
        caller through as the probe once the pause is over."""
        if not self._down:
            return
        with self._lock:
            if not self._down:
                return
            now = time.monotonic()
            if now < self._closed_until or now < self._probe_until:
                raise self._refusal()
            self._probe_until = now + PROBE_S
        if self._probe is None:
            return  # the caller's own work is the probe
        try:
            self._probe()
        except Exception:
            self.failed()
            raise self._refusal() from None
        self.succeeded()

    def _refusal(self) -> DatabaseUnavailable:
        return DatabaseUnavailable(
            f"{self._what} unavailable: its database did not answer a moment ago"
        )

    def failed(self) -> None:
        with self._lock:
            self._down = True
            self._probe_until = 0.0
            self._closed_until = time.monotonic() + self._pause_s

    def succeeded(self) -> None:
        """The database answered: every caller may ask it again."""
        if not self._down:
            return
        with self._lock:
            self._down = False
            self._probe_until = 0.0

    def released(self) -> None:
        """The probe ended without learning anything about the database
        (an error of its own): the next caller may probe."""
        if not self._down:
            return
        with self._lock:
            self._probe_until = 0.0
