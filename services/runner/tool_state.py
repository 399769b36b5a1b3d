"""Where the built-in tools keep state every runner must share: the
`counter`'s once-per-idempotency-key effect (agent_io.tools.builtin).

A tool call redone by a successor (its runner died after the call ran, or
handed the session off before the result was committed) must find its
effect already applied, whichever runner the successor is. Runners share
the deployment's database, not their data dirs (a pod's is its own
`emptyDir`), so on PostgreSQL the state is two tables of the deployment's
schema; under SQLite (`keel up`: every process on one host, one data dir)
it is the file `counter.sqlite3` of that data dir, as each service's store
is a file there.
"""

from __future__ import annotations

import threading

import psycopg
from psycopg import sql

from agent_io.tools.builtin import CounterEffects, CounterStore
from services.common.config import Settings
from services.common.errors import ServiceUnavailable

# Serializes the tables' creation between runners starting at once.
_CREATE_LOCK_KEY = 0x6B65656C746F6F6C  # "keeltool"


class ToolStateUnavailable(ServiceUnavailable):
    """The database holding the tools' state cannot be reached."""


class PostgresCounterStore:
    """`CounterEffects` in the deployment's PostgreSQL schema. Its tables are
    made on first use, so a runner that never runs `counter` never needs
    them (and starting a runner does not wait for the database)."""

    def __init__(self, settings: Settings) -> None:
        self._url = settings.database_url
        self._schema = settings.pg_schema
        self._effects = sql.Identifier(settings.pg_schema, "tool_counter_effects")
        self._counters = sql.Identifier(settings.pg_schema, "tool_counters")
        self._made = False
        self._lock = threading.Lock()

    def _connect(self) -> psycopg.Connection[tuple[object, ...]]:
        try:
            conn = psycopg.connect(self._url, connect_timeout=10)
        except psycopg.OperationalError as error:
            raise ToolStateUnavailable(f"the tools' database is unavailable: {error}") from None
        if not self._made:
            self._make_tables(conn)
        return conn

    def _make_tables(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        with self._lock, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_CREATE_LOCK_KEY,))
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self._schema))
            )
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (idem_key text PRIMARY KEY, key text NOT NULL,"
                    " value bigint NOT NULL, executions bigint NOT NULL)"
                ).format(self._effects)
            )
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (key text PRIMARY KEY, value bigint NOT NULL)"
                ).format(self._counters)
            )
            self._made = True

    def apply(self, key: str, idem_key: str) -> int:
        with self._connect() as conn, conn.transaction():
            # The first call with `idem_key` inserts its row; a concurrent or
            # later one (a redone call, on any runner) waits for it and finds it.
            claimed = conn.execute(
                sql.SQL(
                    "INSERT INTO {} (idem_key, key, value, executions) VALUES (%s, %s, 0, 1)"
                    " ON CONFLICT (idem_key) DO NOTHING"
                ).format(self._effects),
                (idem_key, key),
            ).rowcount
            if not claimed:
                row = conn.execute(
                    sql.SQL(
                        "UPDATE {} SET executions = executions + 1 WHERE idem_key = %s"
                        " RETURNING value"
                    ).format(self._effects),
                    (idem_key,),
                ).fetchone()
                assert row is not None
                return int(str(row[0]))
            counted = conn.execute(
                sql.SQL(
                    "INSERT INTO {0} (key, value) VALUES (%s, 1) ON CONFLICT (key)"
                    " DO UPDATE SET value = {0}.value + 1 RETURNING value"
                ).format(self._counters),
                (key,),
            ).fetchone()
            assert counted is not None
            value = int(str(counted[0]))
            conn.execute(
                sql.SQL("UPDATE {} SET value = %s WHERE idem_key = %s").format(self._effects),
                (value, idem_key),
            )
            return value

    def value(self, key: str) -> int:
        with self._connect() as conn:
            row = conn.execute(
                sql.SQL("SELECT value FROM {} WHERE key = %s").format(self._counters), (key,)
            ).fetchone()
        return int(str(row[0])) if row is not None else 0

    def executions(self, key: str) -> int:
        with self._connect() as conn:
            row = conn.execute(
                sql.SQL("SELECT COALESCE(SUM(executions), 0) FROM {} WHERE key = %s").format(
                    self._effects
                ),
                (key,),
            ).fetchone()
        return int(str(row[0])) if row is not None else 0


def counter_store(settings: Settings) -> CounterEffects:
    """The `counter`'s state for a deployment with these settings: what every
    runner of it (and a test reading it back) shares."""
    if settings.uses_postgres:
        return PostgresCounterStore(settings)
    return CounterStore(settings.sqlite_path("counter"))
