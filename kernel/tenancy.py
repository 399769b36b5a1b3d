"""Tenants, their API keys and their versioned loadouts.

API keys are stored only as SHA-256 hashes: the plain key is returned once
by `create_api_key` and never again. A key is a long random token, so one
unsalted hash is enough (it cannot be brute-forced like a password) and
lets `authenticate` look the key up by its hash directly.

A key belongs to one tenant. An admin key manages that tenant (its loadout,
its sessions in the runtime report); an operator key runs the deployment:
it sees every tenant's sessions in the runtime report and may drain
runtimes, which affects every tenant at once.

A key is revoked, never deleted: its row keeps `revoked_at_ms` and the key
fails `authenticate` from that commit on. Each revocation is also a row of
`key_revocations`, whose growing id lets an edge follow them (kernel
WatchRevocations) and drop the key from its cache at once instead of
trusting it until the cache expires.

A loadout (model, tools, prompt, compaction and admission settings) is
versioned: every put is a new revision 1, 2, 3 … of the tenant, and old
revisions stay readable so a runtime pinned to one can keep using it. Its
document is checked against the schema in kernel.loadout.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from kernel import admission, domain
from kernel.database import Database, Row, Tx
from kernel.errors import (
    ApiKeyExists,
    ApiKeyNotFound,
    InvalidApiKey,
    InvalidArgument,
    LoadoutNotFound,
    RevisionMismatch,
    UnknownTenant,
    WeakApiKey,
)
from kernel.loadout import validate_loadout
from kernel.store import Clock, now_ms

MAX_DOCUMENT_BYTES = 256 << 10
MAX_KEY_CHARS = 512
MIN_KEY_CHARS = 24
MIN_KEY_DISTINCT_CHARS = 10


@dataclass(frozen=True)
class LoadoutRevision:
    """A tenant's loadout document as the kernel stores it, at one revision
    (agent_io.loadout.Loadout is what a runner builds from the document)."""

    tenant_id: str
    # 0 when the tenant has stored none (the document is the default).
    revision: int
    document: dict[str, Any]


@dataclass(frozen=True)
class ApiKeyGrant:
    """What a key may do: act for `tenant_id`, manage it (admin), run the
    deployment (operator)."""

    tenant_id: str
    admin: bool
    operator: bool = False
    # The key's id (`key_…`), for audit records such as an approval's `by`;
    # not part of what the key may do, so grants compare by rights alone.
    key_id: str = field(default="", compare=False)


@dataclass(frozen=True)
class TenantInfo:
    tenant_id: str
    name: str
    created_at_ms: int


@dataclass(frozen=True)
class ApiKeyInfo:
    """A key as listed: never the key itself, which is not stored."""

    key_id: str
    tenant_id: str
    admin: bool
    operator: bool
    created_at_ms: int
    # 0 while the key is valid.
    revoked_at_ms: int = 0


@dataclass(frozen=True)
class Revocation:
    """One revoked key, by the hash an edge caches it under."""

    revocation_id: int
    key_hash: str


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_weakness(key: str) -> str | None:
    """Why `key` is not fit to be an API key, or None. Keys Keel makes are 43
    random characters; one an operator chooses (KEEL_DEV_KEY, CreateApiKey
    with a key) must be long and varied enough not to be guessed."""
    if len(key) > MAX_KEY_CHARS or not key.isprintable() or " " in key:
        return f"an API key is at most {MAX_KEY_CHARS} printable characters without spaces"
    if len(key) < MIN_KEY_CHARS or len(set(key)) < MIN_KEY_DISTINCT_CHARS:
        return (
            f"an API key needs at least {MIN_KEY_CHARS} characters, {MIN_KEY_DISTINCT_CHARS} "
            "of them different (e.g. "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return None


def check_key(key: str) -> str:
    weakness = key_weakness(key)
    if weakness is not None:
        raise WeakApiKey(weakness, field="key")
    return key


def parse_document(document_json: str) -> dict[str, Any]:
    """A loadout document the schema accepts (InvalidLoadout names the field)."""
    if len(document_json.encode()) > MAX_DOCUMENT_BYTES:
        raise InvalidArgument(
            f"a loadout document must be at most {MAX_DOCUMENT_BYTES} bytes", field="document"
        )
    try:
        document = json.loads(document_json)
    except ValueError as exc:
        raise InvalidArgument(f"the loadout is not valid JSON: {exc}", field="document") from None
    except RecursionError:
        raise InvalidArgument("the loadout is nested too deeply", field="document") from None
    return validate_loadout(document)


class TenantStore:
    def __init__(self, database: Database, clock: Clock = now_ms) -> None:
        self._db = database
        self._clock = clock

    @staticmethod
    def _require_tenant(tx: Tx, tenant_id: str, lock: bool = False) -> None:
        query = "SELECT 1 FROM tenants WHERE tenant_id = %s" + (" {lock}" if lock else "")
        if tx.one(query, (tenant_id,)) is None:
            raise UnknownTenant(f"no tenant {tenant_id!r}", tenant_id=tenant_id)

    def create_tenant(self, tenant_id: str, name: str) -> bool:
        """True if created, False if it already existed (idempotent)."""

        def work(tx: Tx) -> bool:
            created = tx.execute(
                "INSERT INTO tenants (tenant_id, name, created_at_ms) VALUES (%s, %s, %s) "
                "ON CONFLICT (tenant_id) DO NOTHING",
                (tenant_id, name, self._clock()),
            )
            return created == 1

        return self._db.run(work)

    def create_api_key(
        self, tenant_id: str, key: str, admin: bool, operator: bool = False
    ) -> tuple[str, str]:
        """(plain key, key id). A caller-chosen key (a fixed dev key) that is
        already the tenant's returns the existing id with the rights asked
        for now, so a restart that creates it again is harmless."""
        plain = check_key(key) if key else "keel_" + secrets.token_urlsafe(32)
        digest = hash_key(plain)

        def work(tx: Tx) -> str:
            self._require_tenant(tx, tenant_id)
            existing = tx.one(
                "SELECT key_id, tenant_id, admin, operator, revoked_at_ms "
                "FROM api_keys WHERE key_hash = %s",
                (digest,),
            )
            if existing is not None:
                if existing[1] != tenant_id:
                    raise ApiKeyExists("this key is already registered", field="key")
                if existing[4]:
                    # Registering it again must not undo a revocation.
                    raise ApiKeyExists("this key was revoked; choose another", field="key")
                if (bool(existing[2]), bool(existing[3])) != (admin, operator):
                    tx.execute(
                        "UPDATE api_keys SET admin = %s, operator = %s WHERE key_id = %s",
                        (int(admin), int(operator), existing[0]),
                    )
                return str(existing[0])
            key_id = "key_" + secrets.token_hex(6)
            tx.execute(
                "INSERT INTO api_keys "
                "(key_id, tenant_id, key_hash, admin, operator, created_at_ms) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                (key_id, tenant_id, digest, int(admin), int(operator), self._clock()),
            )
            return key_id

        return plain, self._db.run(work)

    def authenticate(self, key: str) -> ApiKeyGrant:
        """What a plain key may do; InvalidApiKey if unknown."""
        if not key or len(key) > MAX_KEY_CHARS:
            raise InvalidApiKey("missing or unknown API key")
        row = self._db.run(
            lambda tx: tx.one(
                "SELECT tenant_id, admin, operator, key_id FROM api_keys "
                "WHERE key_hash = %s AND revoked_at_ms = 0",
                (hash_key(key),),
            ),
            write=False,
        )
        if row is None:
            raise InvalidApiKey("missing or unknown API key")
        return ApiKeyGrant(str(row[0]), bool(row[1]), bool(row[2]), str(row[3]))

    def list_tenants(self) -> list[TenantInfo]:
        rows = self._db.run(
            lambda tx: tx.rows(
                "SELECT tenant_id, name, created_at_ms FROM tenants ORDER BY tenant_id"
            ),
            write=False,
        )
        return [TenantInfo(str(r[0]), str(r[1]), int(r[2])) for r in rows]

    def list_api_keys(self, tenant_id: str = "") -> list[ApiKeyInfo]:
        """The keys of one tenant ("" = every tenant's), oldest first."""

        def work(tx: Tx) -> list[Row]:
            columns = "key_id, tenant_id, admin, operator, created_at_ms, revoked_at_ms"
            if not tenant_id:
                return tx.rows(f"SELECT {columns} FROM api_keys ORDER BY created_at_ms, key_id")
            self._require_tenant(tx, tenant_id)
            return tx.rows(
                f"SELECT {columns} FROM api_keys WHERE tenant_id = %s "
                "ORDER BY created_at_ms, key_id",
                (tenant_id,),
            )

        return [
            ApiKeyInfo(str(r[0]), str(r[1]), bool(r[2]), bool(r[3]), int(r[4]), int(r[5]))
            for r in self._db.run(work, write=False)
        ]

    def revoke_api_key(self, key_id: str) -> bool:
        """True if this call revoked the key, False if it already was."""

        def work(tx: Tx) -> bool:
            if self._db.dialect == "postgres":
                # Revocation ids must become visible in id order, or a watcher
                # that has read id 6 would never see a 5 committed after it.
                # One revoker at a time makes commit order the id order
                # (SQLite's BEGIN IMMEDIATE already serializes writers).
                tx.execute("LOCK TABLE key_revocations IN EXCLUSIVE MODE")
            row = tx.one(
                "SELECT key_hash, revoked_at_ms FROM api_keys WHERE key_id = %s {lock}",
                (key_id,),
            )
            if row is None:
                raise ApiKeyNotFound(f"no API key {key_id!r}", key_id=key_id)
            if row[1]:
                return False
            at = max(self._clock(), 1)  # 0 would read as "not revoked"
            tx.execute("UPDATE api_keys SET revoked_at_ms = %s WHERE key_id = %s", (at, key_id))
            tx.execute(
                "INSERT INTO key_revocations (key_hash, revoked_at_ms) VALUES (%s, %s)",
                (row[0], at),
            )
            return True

        return self._db.run(work)

    def revocations_after(self, after_id: int, limit: int = 1000) -> list[Revocation]:
        rows = self._db.run(
            lambda tx: tx.rows(
                "SELECT id, key_hash FROM key_revocations WHERE id > %s ORDER BY id LIMIT %s",
                (after_id, limit),
            ),
            write=False,
        )
        return [Revocation(int(r[0]), str(r[1])) for r in rows]

    def last_revocation_id(self) -> int:
        row = self._db.run(
            lambda tx: tx.one("SELECT COALESCE(MAX(id), 0) FROM key_revocations"), write=False
        )
        return int(row[0]) if row else 0

    def put_loadout(
        self, tenant_id: str, document: dict[str, Any], expected_revision: int = 0
    ) -> int:
        """Stores a new revision and applies its admission limit at once.

        With `expected_revision`, only if that is still the latest one (a
        read-edit-write that lost to another writer gets RevisionMismatch
        instead of silently undoing the other's change)."""
        validate_loadout(document)
        text = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
        max_runs = domain.max_runs_of(document)

        def work(tx: Tx) -> int:
            # The tenant row lock serializes concurrent puts of one tenant.
            self._require_tenant(tx, tenant_id, lock=True)
            row = tx.one(
                "SELECT COALESCE(MAX(revision), 0) FROM loadouts WHERE tenant_id = %s",
                (tenant_id,),
            )
            latest = int(row[0]) if row else 0
            if expected_revision and expected_revision != latest:
                raise RevisionMismatch(
                    f"the loadout of {tenant_id!r} is at revision {latest}, "
                    f"not {expected_revision}",
                    current_revision=str(latest),
                    expected_revision=str(expected_revision),
                )
            revision = latest + 1
            tx.execute(
                "INSERT INTO loadouts (tenant_id, revision, document, created_at_ms) "
                "VALUES (%s, %s, %s, %s)",
                (tenant_id, revision, text, self._clock()),
            )
            admission.set_limit(tx, tenant_id, max_runs)
            return revision

        return self._db.run(work)

    def get_loadout(self, tenant_id: str, revision: int) -> LoadoutRevision:
        """Revision 0 is the latest; the default document when none is stored."""

        def work(tx: Tx) -> LoadoutRevision:
            self._require_tenant(tx, tenant_id)
            if revision == 0:
                row = tx.one(
                    "SELECT revision, document FROM loadouts WHERE tenant_id = %s "
                    "ORDER BY revision DESC LIMIT 1",
                    (tenant_id,),
                )
                if row is None:
                    return LoadoutRevision(tenant_id, 0, domain.default_loadout())
            else:
                row = tx.one(
                    "SELECT revision, document FROM loadouts "
                    "WHERE tenant_id = %s AND revision = %s",
                    (tenant_id, revision),
                )
                if row is None:
                    raise LoadoutNotFound(
                        f"tenant {tenant_id!r} has no loadout revision {revision}",
                        revision=str(revision),
                    )
            return LoadoutRevision(tenant_id, int(row[0]), json.loads(row[1]))

        return self._db.run(work, write=False)
