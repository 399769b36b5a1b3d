"""Shared fixtures: real PostgreSQL (a fresh schema per test) and SQLite.

PostgreSQL comes from KEEL_TEST_DATABASE_URL (default: the local server).
Where it cannot be reached a PostgreSQL test is skipped on a developer
machine, but with CI=true it fails: CI must never pass by skipping.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from services.common.config import Settings
from tests.support.databases import drop_schema, pg_url
from tests.support.internal_auth import with_token
from tests.support.replicas import ledger_processes

ROOT = Path(__file__).resolve().parent.parent
# MCP test servers run the test's interpreter and write into the test's
# private tmp dirs, which the sandbox's uid cannot reach: runners of the tests
# start them unsandboxed (tests/tools/test_child_secrets.py turns it on).
os.environ.setdefault("KEEL_TOOL_SANDBOX", "off")


def _pg_reachable() -> str | None:
    try:
        with psycopg.connect(pg_url(), connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def postgres_url() -> str:
    problem = _pg_reachable()
    if problem is not None:
        message = f"PostgreSQL at {pg_url()} is not reachable: {problem}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: PostgreSQL tests must run)")
        pytest.skip(message)
    return pg_url()


@pytest.fixture
def pg_settings(postgres_url: str, tmp_path: Path) -> Iterator[Settings]:
    """Settings on PostgreSQL with a schema of this test's own (and the
    internal token, as every deployed service has one)."""
    schema = f"keel_t_{uuid.uuid4().hex[:12]}"
    yield with_token(
        Settings(database_url=postgres_url, pg_schema=schema, data_dir=tmp_path / "data")
    )
    drop_schema(postgres_url, schema)


@pytest.fixture
def two_ledgers(pg_settings: Settings) -> Iterator[tuple[str, str]]:
    """The addresses of two ledger processes on the database of `pg_settings`."""
    with ledger_processes(pg_settings, 2) as (first, second):
        yield first, second


@pytest.fixture
def sqlite_settings(tmp_path: Path) -> Settings:
    return with_token(Settings(data_dir=tmp_path / "data"))


@pytest.fixture(params=["sqlite", "postgres"])
def settings(request: pytest.FixtureRequest) -> Settings:
    """Both backends: every test using this runs on SQLite and PostgreSQL."""
    name = "sqlite_settings" if request.param == "sqlite" else "pg_settings"
    value: Settings = request.getfixturevalue(name)
    return value
