"""Which database the ledger's eventsourcing application uses, and its schema.

`KEEL_DATABASE_URL=postgresql://…` selects PostgreSQL (psycopg 3 with a
connection pool); otherwise each service has its own SQLite file under the
data directory. Tables are created here rather than by the library so that
two replicas starting at once serialize on an advisory lock instead of
racing on `CREATE TABLE IF NOT EXISTS` (which PostgreSQL does not make
atomic across sessions).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Collection
from typing import Any, TypeVar, cast

import psycopg
from eventsourcing.application import Application
from eventsourcing.persistence import ApplicationRecorder, InterfaceError, OperationalError
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
from eventsourcing.utils import retry
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import tuple_row

from services.common.config import Settings
from services.common.pg_pool import heal_quickly


class LedgerApplication(Application[str]):
    """The eventsourcing application holding every session stream.

    Its name makes the table `ledger_events`.
    """

    name = "Ledger"


TABLE = "ledger_events"
# The event store tries each statement up to 10 times, 0.2 s apart, when it
# gets no connection: a short wait per try keeps a caller's whole wait during
# an outage to about 4 s (a busy pool still gets the ten tries).
EVENT_STORE_CHECKOUT_TIMEOUT_S = 0.2


def _pg_params(url: str) -> dict[str, Any]:
    params = conninfo_to_dict(url)
    return {
        "POSTGRES_DBNAME": str(params.get("dbname", "postgres")),
        "POSTGRES_HOST": str(params.get("host", "127.0.0.1")),
        "POSTGRES_PORT": str(params.get("port", "5432")),
        "POSTGRES_USER": str(params.get("user", "postgres")),
        "POSTGRES_PASSWORD": str(params.get("password", "")),
    }


def backend_env(settings: Settings) -> dict[str, str]:
    env = {
        "ORIGINATOR_ID_TYPE": "text",
        # Tables are created by prepare_backend() under a lock.
        "CREATE_TABLE": "n",
    }
    if settings.uses_postgres:
        env.update(_pg_params(settings.database_url))
        env.update(
            {
                "PERSISTENCE_MODULE": "eventsourcing.postgres",
                "POSTGRES_SCHEMA": settings.pg_schema,
                "POSTGRES_POOL_SIZE": "6",
                "POSTGRES_MAX_OVERFLOW": "10",
                "POSTGRES_CONNECT_TIMEOUT": "5",
                "POSTGRES_PRE_PING": "n",
                "POSTGRES_LOCK_TIMEOUT": "10",
                "APPLICATION_RECORDER_TOPIC": "services.ledger.backend:SessionNotifyingRecorder",
            }
        )
    else:
        env.update(
            {
                "PERSISTENCE_MODULE": "eventsourcing.sqlite",
                "SQLITE_DBNAME": str(settings.sqlite_path("ledger")),
                "SQLITE_LOCK_TIMEOUT": "10",
            }
        )
    return env


def _advisory_key(schema: str) -> int:
    return zlib.crc32(f"keel-ledger-schema:{schema}".encode()) & 0x7FFFFFFF


def prepare_backend(settings: Settings) -> None:
    """Creates the schema and tables once, safely under concurrent starts."""
    if not settings.uses_postgres:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        LedgerApplication(env=backend_env(settings) | {"CREATE_TABLE": "y"}).close()
        return
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_advisory_key(settings.pg_schema),))
        try:
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(settings.pg_schema))
            )
            LedgerApplication(env=backend_env(settings) | {"CREATE_TABLE": "y"}).close()
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_advisory_key(settings.pg_schema),))


def list_originators(recorder: ApplicationRecorder, after: str, limit: int) -> list[str]:
    """Session ids > `after`, ascending: the distinct stream ids of the table."""
    datastore: Any = getattr(recorder, "datastore")  # noqa: B009 - backend specific
    table = getattr(recorder, "events_table_name")  # noqa: B009
    if hasattr(datastore, "schema"):
        query = sql.SQL(
            "SELECT DISTINCT originator_id FROM {}.{} WHERE originator_id > %s "
            "ORDER BY originator_id LIMIT %s"
        ).format(sql.Identifier(datastore.schema), sql.Identifier(table))
        with datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(query, (after, limit))
            return [row["originator_id"] for row in curs.fetchall()]
    with datastore.transaction(commit=False) as curs:
        curs.execute(
            f"SELECT DISTINCT originator_id FROM {table} WHERE originator_id > ? "
            "ORDER BY originator_id LIMIT ?",
            (after, limit),
        )
        return [row[0] for row in curs.fetchall()]


# A stored row of a session stream: (seq, topic, state).
StoredRow = tuple[int, str, bytes]
_Read = TypeVar("_Read", bound=Callable[..., Any])
# The library's own retry of reads that found no connection (typed here).
_retried_read = cast(
    Callable[[_Read], _Read], retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
)


class StreamRows:
    """Session streams' rows as stored, read without the library's mapper.

    A page is one statement, with the stream's head in the same snapshot.
    It asks for the seq range `(after, after + limit]` as well as for
    `limit` rows: a stream has no gaps, so that is the same page, and it
    bounds the scan even when the planner has no statistics for the table
    (without them PostgreSQL sorted every row after `after` for each page).
    On PostgreSQL rows travel in the binary protocol: the state column is
    bytea, which as text travels hex-encoded, twice its size. Retried like
    the library's own reads when no connection is to be had.
    """

    def __init__(self, recorder: ApplicationRecorder) -> None:
        self._datastore: Any = getattr(recorder, "datastore")  # noqa: B009 - backend specific
        table = getattr(recorder, "events_table_name")  # noqa: B009
        self._postgres = hasattr(self._datastore, "schema")
        if self._postgres:
            name = sql.Identifier(self._datastore.schema, table)
            rows = sql.SQL(
                "SELECT originator_version, topic, state{head} FROM {t} "
                "WHERE originator_id = %(id)s AND originator_version > %(after)s "
                "AND originator_version <= %(upto)s "
                "ORDER BY originator_version LIMIT %(limit)s"
            )
            head = sql.SQL("SELECT max(originator_version) FROM {t} WHERE originator_id = %(id)s")
            self._rows_sql: Any = rows.format(head=sql.SQL(""), t=name)
            # The head on every row: an uncorrelated subquery, run once.
            self._page_sql: Any = rows.format(
                head=sql.SQL(", ({})").format(head.format(t=name)), t=name
            )
            self._head_sql: Any = head.format(t=name)
        else:
            self._rows_sql = (
                f"SELECT originator_version, topic, state FROM {table} "
                "WHERE originator_id = :id AND originator_version > :after "
                "AND originator_version <= :upto ORDER BY originator_version LIMIT :limit"
            )
            self._head_sql = (
                f"SELECT max(originator_version) FROM {table} WHERE originator_id = :id"
            )

    @_retried_read
    def rows(self, session_id: str, after: int, limit: int) -> list[StoredRow]:
        """Up to `limit` rows after seq `after`, in seq order."""
        params = {"id": session_id, "after": after, "upto": after + limit, "limit": limit}
        if not self._postgres:
            with self._datastore.transaction(commit=False) as curs:
                curs.execute(self._rows_sql, params)
                return [(row[0], row[1], row[2]) for row in curs.fetchall()]
        with (
            self._datastore.get_connection() as conn,
            conn.cursor(binary=True, row_factory=tuple_row) as curs,
        ):
            curs.execute(self._rows_sql, params, prepare=True)
            rows: list[StoredRow] = curs.fetchall()
            return rows

    @_retried_read
    def page(self, session_id: str, after: int, limit: int) -> tuple[list[StoredRow], int]:
        """`rows()` and the stream's head (0: no such stream)."""
        params = {"id": session_id, "after": after, "upto": after + limit, "limit": limit}
        if not self._postgres:
            with self._datastore.transaction(commit=False) as curs:
                curs.execute(self._rows_sql, params)
                rows = [(row[0], row[1], row[2]) for row in curs.fetchall()]
                if rows and len(rows) < limit:  # a short page ends at the head
                    return rows, rows[-1][0]
                curs.execute(self._head_sql, params)
                return rows, int(curs.fetchone()[0] or 0)
        with (
            self._datastore.get_connection() as conn,
            conn.cursor(binary=True, row_factory=tuple_row) as curs,
        ):
            curs.execute(self._page_sql, params, prepare=True)
            found = curs.fetchall()
            if not found:  # nothing after `after`: the head alone
                curs.execute(self._head_sql, params, prepare=True)
                return [], int(curs.fetchone()[0] or 0)
        return [(seq, topic, state) for seq, topic, state, _ in found], int(found[0][3])

    @_retried_read
    def head(self, session_id: str) -> int:
        """The stream's latest seq; 0 when there is no such stream."""
        params = {"id": session_id}
        if not self._postgres:
            with self._datastore.transaction(commit=False) as curs:
                curs.execute(self._head_sql, params)
                return int(curs.fetchone()[0] or 0)
        with (
            self._datastore.get_connection() as conn,
            conn.cursor(row_factory=tuple_row) as curs,
        ):
            curs.execute(self._head_sql, params, prepare=True)
            return int(curs.fetchone()[0] or 0)


class SessionNotifyingRecorder(PostgresApplicationRecorder):
    """The library's recorder, with the channel on which the ledger's writes
    name the sessions they touched.

    The ledger inserts through `services.ledger.event_insert.BatchInsert`,
    whose statement NOTIFYs this channel in the same transaction; other
    ledger processes LISTEN (`LiveTail`) and wake exactly those sessions'
    subscribers, without relying on notification ids committing in order
    (they don't once the table lock is gone). The library's own insert
    function is never called, so it is not created (a database that has it
    from an earlier release keeps it, unused).
    """

    def __init__(self, datastore: PostgresDatastore, *, events_table_name: str = TABLE) -> None:
        super().__init__(datastore, events_table_name=events_table_name)
        # Made by the library with its own pool settings; an outage must
        # not leave the ledger waiting half a minute once the server is back.
        heal_quickly(datastore.pool, EVENT_STORE_CHECKOUT_TIMEOUT_S)
        self.session_channel = f"{self.channel_name}_sessions"
        del self.sql_create_statements[self.create_insert_function_statement_index]


class LiveTail:
    """Wakes local subscribers when any ledger process commits to a session.

    LISTENs to the session channel of `SessionNotifyingRecorder`. A payload of
    `*` (too many sessions to name) wakes everyone; subscribers read from their
    own cursor, so a spurious or coalesced wake-up is harmless.
    """

    def __init__(
        self,
        database_url: str,
        channel: str,
        on_commit: Callable[[Collection[str]], None],
        own_backends: Collection[int] = (),
    ):
        self._url = database_url
        self._channel = channel
        self._on_commit = on_commit
        # Server pids of this ledger's writing connections: their commits
        # were announced in-process already. (A pid reused by another
        # process's connection after ours closed would be skipped too; its
        # subscribers still see the facts within the safety poll.)
        self._own = own_backends
        self._stopped = threading.Event()
        self.listening = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-live-tail", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                with psycopg.connect(self._url, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                    self.listening.set()
                    # Anything committed while we were not listening: wake all.
                    self._on_commit(("*",))
                    while not self._stopped.is_set():
                        for note in conn.notifies(timeout=0.2):
                            if note.pid not in self._own:
                                self._on_commit(note.payload.split(","))
            except psycopg.Error:
                self.listening.clear()
                if self._stopped.wait(0.5):
                    return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
