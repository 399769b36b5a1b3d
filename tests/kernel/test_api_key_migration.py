"""A database made before operator keys and key revocation gets the new
column and table, on both backends."""

from __future__ import annotations

import sqlite3

import psycopg
import pytest
from psycopg import sql

from kernel.database import Database
from kernel.errors import InvalidApiKey
from kernel.tenancy import ApiKeyGrant, TenantStore, hash_key
from services.common.config import Settings

# `tenants` and `api_keys` as releases before operator keys created them.
OLD_TABLES = (
    """
    CREATE TABLE tenants (
        tenant_id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        created_at_ms BIGINT NOT NULL
    )
    """,
    """
    CREATE TABLE api_keys (
        key_id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants (tenant_id),
        key_hash TEXT NOT NULL UNIQUE,
        admin INTEGER NOT NULL,
        created_at_ms BIGINT NOT NULL
    )
    """,
)
OLD_KEY = "old-admin-key-0123456789"
OLD_ROWS = (
    "INSERT INTO tenants (tenant_id, name, created_at_ms) VALUES ('acme', '', 1)",
    "INSERT INTO api_keys (key_id, tenant_id, key_hash, admin, created_at_ms) "
    f"VALUES ('key_old', 'acme', '{hash_key(OLD_KEY)}', 1, 1)",
)


def _create_old_tables(settings: Settings) -> None:
    if settings.uses_postgres:
        with psycopg.connect(settings.database_url, autocommit=True) as conn:
            schema = sql.Identifier(settings.pg_schema)
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
            conn.execute(sql.SQL("SET search_path TO {}").format(schema))
            for statement in (*OLD_TABLES, *OLD_ROWS):
                conn.execute(statement.encode())
        return
    settings.data_dir.mkdir(parents=True)
    with sqlite3.connect(settings.sqlite_path("kernel")) as file:
        for statement in (*OLD_TABLES, *OLD_ROWS):
            file.execute(statement)
    file.close()


def test_keys_made_before_operator_keys_keep_working_and_are_not_operators(
    settings: Settings,
) -> None:
    _create_old_tables(settings)
    database = Database(settings)
    try:
        tenants = TenantStore(database)
        assert tenants.authenticate(OLD_KEY) == ApiKeyGrant("acme", admin=True, operator=False)
        key, _ = tenants.create_api_key("acme", "", admin=False, operator=True)
        assert tenants.authenticate(key) == ApiKeyGrant("acme", admin=False, operator=True)
    finally:
        database.close()
    # Opening it again finds the column there and leaves it alone.
    database = Database(settings)
    try:
        assert TenantStore(database).authenticate(key).operator
    finally:
        database.close()


def test_keys_made_before_revocation_are_valid_and_can_be_revoked(settings: Settings) -> None:
    _create_old_tables(settings)
    database = Database(settings)
    try:
        tenants = TenantStore(database)
        [old] = tenants.list_api_keys("acme")
        assert old.key_id == "key_old" and old.revoked_at_ms == 0
        assert tenants.authenticate(OLD_KEY).tenant_id == "acme"
        assert tenants.revoke_api_key("key_old")
        [revocation] = tenants.revocations_after(0)
        assert revocation.key_hash == hash_key(OLD_KEY)
    finally:
        database.close()
    database = Database(settings)
    try:
        with pytest.raises(InvalidApiKey):
            TenantStore(database).authenticate(OLD_KEY)
    finally:
        database.close()
