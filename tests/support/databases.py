"""The test PostgreSQL server, and the store settings a child process inherits.

Fixtures (tests/conftest.py) give each test a schema of its own on
KEEL_TEST_DATABASE_URL; tests that start OS processes hand them the same
store through `settings_env`.
"""

from __future__ import annotations

import os

import psycopg
from psycopg import sql

from services.common.config import Settings
from tests.support.internal_auth import auth_env

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"


def pg_url() -> str:
    return os.environ.get("KEEL_TEST_DATABASE_URL", DEFAULT_PG)


def drop_schema(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment a child process needs to use the same store."""
    env = dict(os.environ)
    env.update(
        {
            "KEEL_DATABASE_URL": settings.database_url,
            "KEEL_PG_SCHEMA": settings.pg_schema,
            "KEEL_DATA_DIR": str(settings.data_dir),
            "KEEL_LEASE_MS": str(settings.lease_ms),
            "PYTHONUNBUFFERED": "1",
            **auth_env(settings),
        }
    )
    return env
