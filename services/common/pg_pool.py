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
import time
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from services.common.errors import DatabaseUnavailable

CHECKOUT_TIMEOUT_S = 3.0
RECONNECT_TIMEOUT_S = 2.0
# How long an OutageGate refuses without asking after a failure: well under
# the Retry-After clients are given.
OUTAGE_PAUSE_S = 0.5


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
    """Refuses at once, for a moment, after the database failed to answer.

    A service whose every call waits out a pool timeout during an outage
    also holds its locks that long: one writer thread retrying batch after
    batch keeps readers from ever getting their turn, and each caller waits
    seconds for an answer known in advance. Once the database has failed,
    calls for the next `pause_s` are refused without asking it; the first
    call after that asks again, so recovery costs at most `pause_s`.
    """

    def __init__(self, what: str, pause_s: float = OUTAGE_PAUSE_S) -> None:
        self._what = what
        self._pause_s = pause_s
        # A float read and written whole: no lock needed.
        self._closed_until = 0.0

    def check(self) -> None:
        """Raises DatabaseUnavailable while the gate is closed."""
        if time.monotonic() < self._closed_until:
            raise DatabaseUnavailable(
                f"{self._what} unavailable: its database did not answer a moment ago"
            )

    def failed(self) -> None:
        self._closed_until = time.monotonic() + self._pause_s
