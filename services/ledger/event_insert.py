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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eventsourcing.persistence import InterfaceError, Mapper, OperationalError
from eventsourcing.utils import retry
from psycopg import sql

from services.ledger.backend import SessionNotifyingRecorder

# The NOTIFY payload limit is 8000 bytes: past this, the payload is `*`
# ("wake every subscriber"); `LiveTail` wakes everyone on it.
MAX_NAMED_SESSIONS_CHARS = 7000


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

    def put(self, events: Sequence[Any]) -> None:
        stored = [self._mapper.to_stored_event(event) for event in events]
        if not stored:
            return
        sessions = ",".join(dict.fromkeys(str(s.originator_id) for s in stored))
        if len(sessions) > MAX_NAMED_SESSIONS_CHARS:
            sessions = "*"
        self._execute(
            (
                [str(s.originator_id) for s in stored],
                [s.originator_version for s in stored],
                [s.topic for s in stored],
                [s.state for s in stored],
                self._channel,
                sessions,
            )
        )

    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    def _execute(self, params: tuple[Any, ...]) -> None:
        with self._datastore.get_connection() as conn, conn.cursor(binary=True) as curs:
            # Before the statement: its NOTIFY may reach the LiveTail first.
            self.backends.add(conn.info.backend_pid)
            curs.execute(self._statement, params, prepare=True)
