"""`BatchInsert`: a batch's new events in one PostgreSQL statement.

What the library's path did for the same batch (`EventStore.put` through a
plpgsql function, no longer created) cost twice the database time of a plain
INSERT and a quarter of the ledger's CPU per append: each event was packed
into a composite-type array in Python (text protocol), then unpacked and
inserted by the function. Here the rows go as four column arrays in the
binary protocol, and the NOTIFY naming the sessions written rides in the
same statement, so it commits with the rows (a woken subscriber always finds
them) in one round trip (the pool's connections are in autocommit).

Same rows, same encoding (the application's mapper), same errors (the
datastore maps psycopg's to the library's: a key conflict is IntegrityError),
same retries when no connection is to be had. SQLite keeps the library path.

Turns settled in the same statement: appends that carry their attempt's
Finish (`Settlement`) call the kernel's settlement function in the same
statement (services/common/turn_settlement.py), so the answer and its
lease's settlement commit as one, still in one round trip. The function
exists only where the kernel keeps its tables in this database; until it is
seen, nothing is settled here and runners send their Finish.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from eventsourcing.persistence import InterfaceError, Mapper, OperationalError
from eventsourcing.utils import retry
from psycopg import sql

from services.common import turn_settlement
from services.ledger.backend import SessionNotifyingRecorder
from services.ledger.views import Settlement

# The NOTIFY payload limit is 8000 bytes: past this, the payload is `*`
# ("wake every subscriber"); `LiveTail` wakes everyone on it.
MAX_NAMED_SESSIONS_CHARS = 7000
# How long a look that found no settlement function holds: a kernel that
# creates its tables later is noticed within this.
SETTLEMENT_RECHECK_S = 10.0


class BatchInsert:
    """Inserts session events, with the NOTIFY of `SessionNotifyingRecorder`."""

    def __init__(self, recorder: SessionNotifyingRecorder, mapper: Mapper[Any]) -> None:
        self._datastore = recorder.datastore
        self._mapper = mapper
        self._channel = recorder.session_channel
        # The server processes of the connections that wrote: their NOTIFYs
        # are this ledger's own commits, whose subscribers were handed the
        # facts already (services.ledger.waker), so the LiveTail skips them.
        self.backends: set[int] = set()
        table = sql.Identifier(self._datastore.schema, recorder.events_table_name)
        # A data-modifying WITH runs whether or not it is referenced; the
        # SELECT then notifies once, in the same transaction.
        self._statement = sql.SQL(
            "WITH inserted AS ("
            " INSERT INTO {table} (originator_id, originator_version, topic, state)"
            " SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::bytea[])"
            " RETURNING 1)"
            " SELECT pg_notify(%s, %s)"
        ).format(table=table)
        # The same, settling turns too: one row per settled session (one
        # row of NULLs when none was). The settlement is referenced, so it
        # runs; the NOTIFY's CTE is referenced once, so it notifies once.
        self._settling_statement = sql.SQL(
            "WITH inserted AS ("
            " INSERT INTO {table} (originator_id, originator_version, topic, state)"
            " SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::bytea[])"
            " RETURNING 1),"
            " settled AS (SELECT * FROM {function}("
            "%s::text[], %s::bigint[], %s::text[], %s::bigint[], %s::bigint[], %s::bigint)),"
            " notified AS (SELECT pg_notify(%s, %s))"
            " SELECT settled.settled_session, settled.settled_until_ms"
            " FROM notified LEFT JOIN settled ON true"
        ).format(
            table=table,
            function=sql.Identifier(self._datastore.schema, turn_settlement.FUNCTION),
        )
        self._function = f"{self._datastore.schema}.{turn_settlement.SIGNATURE}"
        self._fork_statement = sql.SQL(
            "WITH own AS ("
            " INSERT INTO {table} (originator_id, originator_version, topic, state)"
            " SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::bytea[])"
            " RETURNING 1),"
            " copied AS ("
            " INSERT INTO {table} (originator_id, originator_version, topic, state)"
            " SELECT %s, originator_version, topic, state FROM {table}"
            " WHERE originator_id = %s AND originator_version BETWEEN 2 AND %s"
            " RETURNING 1)"
            " SELECT pg_notify(%s, %s)"
        ).format(table=table)
        self._can_settle = False
        self._looked_at = -SETTLEMENT_RECHECK_S

    def put(
        self, events: Sequence[Any], settles: Mapping[str, tuple[int, Settlement]] | None = None
    ) -> dict[str, int]:
        """Inserts `events`; settles the turns of `settles` ({session: (epoch,
        settlement)}) where the kernel's function allows. Returns the end of
        the sticky window of each session settled."""
        stored = [self._mapper.to_stored_event(event) for event in events]
        if not stored:
            return {}
        sessions = ",".join(dict.fromkeys(str(s.originator_id) for s in stored))
        if len(sessions) > MAX_NAMED_SESSIONS_CHARS:
            sessions = "*"
        rows = (
            [str(s.originator_id) for s in stored],
            [s.originator_version for s in stored],
            [s.topic for s in stored],
            [s.state for s in stored],
        )
        if not settles or not self._settlement_exists():
            self._execute(self._statement, (*rows, self._channel, sessions))
            return {}
        ids = list(settles)
        settling = (
            ids,
            [settles[i][0] for i in ids],
            [settles[i][1].runtime_id for i in ids],
            [settles[i][1].read_through for i in ids],
            [settles[i][1].sticky_ms for i in ids],
            time.time_ns() // 1_000_000,
        )
        settled = self._execute(
            self._settling_statement, (*rows, *settling, self._channel, sessions)
        )
        # The library's connections answer rows as dicts.
        return {
            str(row["settled_session"]): int(row["settled_until_ms"])
            for row in settled
            if row["settled_session"] is not None
        }

    def put_fork(self, events: Sequence[Any], parent_id: str, fork_id: str, at_seq: int) -> None:
        """Inserts a fork's own `events` (its creation and `forked_from`) and,
        in the same statement, copies the parent's stored events 2..`at_seq`
        under the fork's id, on the server: a stored event's state holds no
        originator id or version (they are columns), so the rows copy as
        they are, timestamps included, without a round trip through Python."""
        stored = [self._mapper.to_stored_event(event) for event in events]
        self._execute(
            self._fork_statement,
            (
                [str(s.originator_id) for s in stored],
                [s.originator_version for s in stored],
                [s.topic for s in stored],
                [s.state for s in stored],
                fork_id,
                parent_id,
                at_seq,
                self._channel,
                fork_id,
            ),
        )

    def _settlement_exists(self) -> bool:
        if self._can_settle:
            return True
        if time.monotonic() - self._looked_at < SETTLEMENT_RECHECK_S:
            return False
        self._looked_at = time.monotonic()
        with self._datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute("SELECT to_regprocedure(%s) IS NOT NULL AS present", (self._function,))
            row = curs.fetchone()
        self._can_settle = bool(row and row["present"])
        return self._can_settle

    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    def _execute(self, statement: sql.Composed, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        with self._datastore.get_connection() as conn, conn.cursor(binary=True) as curs:
            # Before the statement: its NOTIFY may reach the LiveTail first.
            self.backends.add(conn.info.backend_pid)
            curs.execute(statement, params, prepare=True)
            return curs.fetchall()
