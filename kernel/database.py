"""The kernel's tables on PostgreSQL (psycopg 3 + a pool) or a SQLite file.

Queries are written once, PostgreSQL-style (`%s` placeholders), with two
tokens a dialect fills in: `{lock}` (`FOR UPDATE` — row locks, so a
read-decide-write never loses an update) and `{skip_locked}` (`FOR UPDATE OF
s SKIP LOCKED` — concurrent claimers take different rows instead of queueing
behind each other). SQLite has neither and needs neither: every write
transaction there is `BEGIN IMMEDIATE`, which serializes writers on the file.

On PostgreSQL every table lives in `Settings.pg_schema` (set as the
connection's search_path). Tables are created under an advisory lock, so two
replicas starting at once do not race on `CREATE … IF NOT EXISTS` (which
PostgreSQL does not make atomic across sessions).
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from kernel.turn_settlement import CREATE_FUNCTION
from services.common import hops
from services.common.config import Settings
from services.common.errors import DatabaseUnavailable, ServiceUnavailable
from services.common.pg_pool import OutageGate, answers, heal_quickly

log = logging.getLogger(__name__)

T = TypeVar("T")
Row = tuple[Any, ...]
# Transactions that lost a deadlock or serialization race are redone.
RETRIES = 5

_TABLES = """
CREATE TABLE IF NOT EXISTS kernel_sessions (
    session_id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    queued INTEGER NOT NULL DEFAULT 0,
    parked INTEGER NOT NULL DEFAULT 0,
    input_seq BIGINT NOT NULL DEFAULT 0,
    not_before_ms BIGINT NOT NULL DEFAULT 0,
    queued_at_ms BIGINT NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'free',
    runtime_id TEXT NOT NULL DEFAULT '',
    attempt_id TEXT NOT NULL DEFAULT '',
    epoch BIGINT NOT NULL DEFAULT 0,
    expires_at_ms BIGINT NOT NULL DEFAULT 0,
    claimed_at_ms BIGINT NOT NULL DEFAULT 0,
    expired_by TEXT NOT NULL DEFAULT '',
    failures INTEGER NOT NULL DEFAULT 0,
    last_error TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS kernel_sessions_runnable
    ON kernel_sessions (queued_at_ms, session_id)
    WHERE queued = 1 AND parked = 0 AND state <> 'held';
CREATE INDEX IF NOT EXISTS kernel_sessions_held_expiry
    ON kernel_sessions (expires_at_ms) WHERE state = 'held';
CREATE INDEX IF NOT EXISTS kernel_sessions_held_by
    ON kernel_sessions (runtime_id) WHERE state = 'held';
CREATE TABLE IF NOT EXISTS kernel_slots (
    tenant_id TEXT PRIMARY KEY,
    in_use INTEGER NOT NULL DEFAULT 0,
    max_runs INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS runtime_instances (
    runtime_id TEXT PRIMARY KEY,
    address TEXT NOT NULL,
    host TEXT NOT NULL,
    pid BIGINT NOT NULL,
    loadout_revision BIGINT NOT NULL,
    version TEXT NOT NULL,
    role TEXT NOT NULL,
    drain_mode TEXT NOT NULL,
    attached INTEGER NOT NULL DEFAULT 0,
    started_at_ms BIGINT NOT NULL,
    seen_at_ms BIGINT NOT NULL DEFAULT 0,
    beat_at_ms BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS handoffs (
    handoff_id {serial},
    old_runtime_id TEXT NOT NULL,
    new_runtime_id TEXT NOT NULL,
    loadout_revision BIGINT NOT NULL,
    in_flight BIGINT NOT NULL,
    session_id TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    at_ms BIGINT NOT NULL
);
-- The handoffs whose successor has not claimed yet: each claim after a
-- release looks its session up here.
CREATE INDEX IF NOT EXISTS handoffs_unnamed
    ON handoffs (session_id) WHERE new_runtime_id = '';
CREATE TABLE IF NOT EXISTS tenants (
    tenant_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (tenant_id),
    key_hash TEXT NOT NULL UNIQUE,
    admin INTEGER NOT NULL,
    created_at_ms BIGINT NOT NULL,
    operator INTEGER NOT NULL DEFAULT 0,
    revoked_at_ms BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS key_revocations (
    id {serial},
    key_hash TEXT NOT NULL,
    revoked_at_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS loadouts (
    tenant_id TEXT NOT NULL REFERENCES tenants (tenant_id),
    revision BIGINT NOT NULL,
    document TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, revision)
);
CREATE TABLE IF NOT EXISTS kernel_schedules (
    schedule_id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    text TEXT NOT NULL,
    cron TEXT NOT NULL DEFAULT '',
    timezone TEXT NOT NULL DEFAULT 'UTC',
    at_ms BIGINT NOT NULL DEFAULT 0,
    next_fire_ms BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS kernel_schedules_due ON kernel_schedules (next_fire_ms);
CREATE INDEX IF NOT EXISTS kernel_schedules_session ON kernel_schedules (session_id)
"""

# Columns added after the first release, as (table, column, type). A
# database created before them (a developer's old kernel.sqlite3, a deployed
# PostgreSQL schema) already has its tables, so `CREATE TABLE IF NOT EXISTS`
# leaves them without these; they are added at start-up instead. Each needs a
# DEFAULT, which fills the rows already there.
_ADDED_COLUMNS = (
    ("runtime_instances", "seen_at_ms", "BIGINT NOT NULL DEFAULT 0"),
    # The runtime's heartbeat on the database's clock (kernel.liveness); 0:
    # never beaten (a row of a kernel from before heartbeats).
    ("runtime_instances", "beat_at_ms", "BIGINT NOT NULL DEFAULT 0"),
    # Keys made before operator keys existed are not operators.
    ("api_keys", "operator", "INTEGER NOT NULL DEFAULT 0"),
    # 0: not revoked. Keys made before revocation existed are all valid.
    ("api_keys", "revoked_at_ms", "BIGINT NOT NULL DEFAULT 0"),
    # Consecutive rate-limited attempts (kernel.retries); none before.
    ("kernel_sessions", "rate_limits", "INTEGER NOT NULL DEFAULT 0"),
)

_SERIAL = {
    "postgres": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    "sqlite": "INTEGER PRIMARY KEY AUTOINCREMENT",
}
# `{db_now_ms}`: the database's own clock in Unix milliseconds, so kernels on
# hosts whose clocks disagree compare heartbeats on one clock.
_TOKENS = {
    "postgres": {
        "lock": "FOR UPDATE",
        "skip_locked": "FOR UPDATE OF s SKIP LOCKED",
        "db_now_ms": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
    },
    "sqlite": {
        "lock": "",
        "skip_locked": "",
        "db_now_ms": "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    },
}


def _statements(dialect: str) -> list[str]:
    text = _TABLES.replace("{serial}", _SERIAL[dialect])
    return [s.strip() for s in text.split(";") if s.strip()]


def _advisory_key(schema: str) -> int:
    return zlib.crc32(f"keel-kernel-schema:{schema}".encode()) & 0x7FFFFFFF


@functools.lru_cache(maxsize=512)
def _writes(query: str) -> bool:
    """Whether a statement may write: anything but a plain read (SELECT,
    locking or not). Queries are a few hundred fixed texts, hence the cache."""
    return not query.lstrip().upper().startswith("SELECT")


class Tx:
    """One open transaction: run statements, read rows."""

    def __init__(self, cursor: Any, translate: Callable[[str], str]) -> None:
        self._cursor = cursor
        self._translate = translate
        # Whether a statement changed a row: only those transactions count
        # as commits (services/common/hops.py). A claim that found nothing, a
        # sweep or prune with nothing to do commit nothing a disk must keep.
        self.wrote = False

    def _run(self, query: str, params: Sequence[Any]) -> None:
        self._cursor.execute(self._translate(query), tuple(params))
        if not self.wrote and _writes(query):
            self.wrote = self._cursor.rowcount > 0

    def rows(self, query: str, params: Sequence[Any] = ()) -> list[Row]:
        self._run(query, params)
        return [tuple(r) for r in self._cursor.fetchall()]

    def one(self, query: str, params: Sequence[Any] = ()) -> Row | None:
        self._run(query, params)
        row = self._cursor.fetchone()
        return None if row is None else tuple(row)

    def execute(self, query: str, params: Sequence[Any] = ()) -> int:
        self._run(query, params)
        return int(self._cursor.rowcount)


class Database:
    """A pool of connections to the kernel's tables and its SQL dialect."""

    def __init__(self, settings: Settings) -> None:
        self.dialect = "postgres" if settings.uses_postgres else "sqlite"
        self._translated: dict[str, str] = {}
        self._closed = False
        # While PostgreSQL is away every call is refused at once but a probe:
        # without it each call would hold one of the servicer's few threads
        # for a pool timeout, and calls queue behind each other for as long
        # as the outage lasts (an edge's wake-up of a committed input too).
        self._gate = OutageGate(
            "kernel store",
            probe=answers(settings.database_url) if settings.uses_postgres else None,
        )
        if self.dialect == "postgres":
            self._schema = settings.pg_schema
            self._create_pg_schema(settings.database_url)
            self._pool: ConnectionPool[psycopg.Connection[Any]] | None = ConnectionPool(
                settings.database_url,
                min_size=2,
                max_size=12,
                open=False,
                configure=self._configure_pg,
                kwargs={"connect_timeout": 5},
                name="keel-kernel",
            )
            heal_quickly(self._pool)
            self._pool.open(wait=True, timeout=30)
        else:
            self._pool = None
            settings.data_dir.mkdir(parents=True, exist_ok=True)
            self._path = str(settings.sqlite_path("kernel"))
            self._idle: list[sqlite3.Connection] = []
            self._guard = threading.Lock()
            self._create_sqlite_schema()

    # -- schema --

    def _create_pg_schema(self, url: str) -> None:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
                key = _advisory_key(self._schema)
                conn.execute("SELECT pg_advisory_lock(%s)", (key,))
                try:
                    conn.execute(
                        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                            sql.Identifier(self._schema)
                        )
                    )
                    conn.execute(
                        sql.SQL("SET search_path TO {}").format(sql.Identifier(self._schema))
                    )
                    for statement in _statements("postgres"):
                        conn.execute(statement.encode())
                    for table, column, kind in _ADDED_COLUMNS:
                        conn.execute(
                            f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {kind}".encode()
                        )
                    # After the tables: the function's row type is theirs.
                    conn.execute(CREATE_FUNCTION.encode())
                finally:
                    conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
        except psycopg.OperationalError as exc:
            raise ServiceUnavailable(f"kernel database unavailable: {exc}") from exc

    def _configure_pg(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self._schema)))
        conn.commit()

    def _create_sqlite_schema(self) -> None:
        with self._sqlite_connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _statements("sqlite"):
                    conn.execute(statement)
                # SQLite has no `ADD COLUMN IF NOT EXISTS`; BEGIN IMMEDIATE
                # keeps another process from adding it between check and add.
                for table, column, kind in _ADDED_COLUMNS:
                    present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
                    if column not in present:
                        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    # -- transactions --

    def _translate(self, query: str) -> str:
        done = self._translated.get(query)
        if done is None:
            done = query.format(**_TOKENS[self.dialect])
            if self.dialect == "sqlite":
                done = done.replace("%s", "?")
            self._translated[query] = done
        return done

    def run(self, work: Callable[[Tx], T], write: bool = True) -> T:
        """Runs `work` in one transaction, redone if it lost a lock race.

        A `KernelError` raised by `work` rolls back and propagates unchanged.
        """
        for attempt in range(RETRIES):
            try:
                if self.dialect == "postgres":
                    return self._run_pg(work)
                return self._run_sqlite(work, write)
            except (pg_errors.DeadlockDetected, pg_errors.SerializationFailure):
                if attempt == RETRIES - 1:
                    raise ServiceUnavailable("kernel store: too much lock contention") from None
                time.sleep(0.005 * (attempt + 1))
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                if attempt == RETRIES - 1:
                    raise ServiceUnavailable(f"kernel store unavailable: {exc}") from exc
            except (
                psycopg.OperationalError,
                psycopg.InterfaceError,
                PoolClosed,
                PoolTimeout,
            ) as exc:
                raise DatabaseUnavailable(f"kernel store unavailable: {exc}") from exc
        raise ServiceUnavailable("kernel store: no attempt left")  # pragma: no cover

    def _run_pg(self, work: Callable[[Tx], T]) -> T:
        assert self._pool is not None
        self._gate.check()
        try:
            with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cursor:
                tx = Tx(cursor, self._translate)
                result = work(tx)
        except (
            pg_errors.DeadlockDetected,
            pg_errors.SerializationFailure,
            pg_errors.TransactionRollback,
        ):
            # A lock race (deadlock, serialization): the database answered.
            self._gate.succeeded()
            raise
        except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout):
            self._gate.failed()
            raise
        except BaseException:
            # The work's own error (a KernelError, a lock race): nothing
            # learnt about whether the database is back.
            self._gate.released()
            raise
        self._gate.succeeded()
        if tx.wrote:
            hops.committed("kernel")
        return result

    def _run_sqlite(self, work: Callable[[Tx], T], write: bool) -> T:
        with self._sqlite_connection() as conn:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            tx = Tx(conn.cursor(), self._translate)
            try:
                result = work(tx)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            if tx.wrote:
                hops.committed("kernel")
            return result

    @contextmanager
    def _sqlite_connection(self) -> Iterator[sqlite3.Connection]:
        with self._guard:
            if self._closed:
                raise ServiceUnavailable("the kernel store is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = sqlite3.connect(
                self._path, isolation_level=None, check_same_thread=False, timeout=10
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
        try:
            yield conn
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            with self._guard:
                # A connection still in use when the store closed (a worker
                # thread outliving its cancelled caller) is closed here, by
                # its last user, never under it.
                if self._closed:
                    conn.close()
                else:
                    self._idle.append(conn)

    def close(self) -> None:
        if self._pool is not None:
            # psycopg_pool closes connections in use when they come back.
            self._closed = True
            self._pool.close()
            return
        with self._guard:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
