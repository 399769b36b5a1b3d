"""Blobs: resumable uploads by offset, and what a model is shown of one.

Create with the total length, then append chunks, each sent with the offset
the client believes the upload has reached; a wrong offset is refused with
the real one, so a client that lost a response asks and resumes instead of
duplicating bytes. When the last byte arrives the blob is complete and carries
its SHA-256. Inputs reference complete blobs by id.

SQLite/embedded deployments keep blobs on disk under the data dir; with
PostgreSQL they live in a table, so every edge replica, runner and compaction
service sees every upload. Every service builds its store from the same
Settings (`blob_store`), which is how `keel up` makes them share one.

A blob id is only ever the `blob-<24 hex>` form `create` makes; anything else
is "not found" before it comes near a path or a query.

Each tenant holds at most `BlobQuota` blobs and bytes. The bytes are the
declared lengths: `create` reserves a blob's whole length, so a client that
declares 500 blobs of 64 MiB is refused once the quota would be passed, before it
sends a single body, and a refused create leaves nothing behind.

This module is a leaf: the edge, the runner and the compaction service all
import it, it imports none of them. What a model sees of a blob is in
`services.blob_parts`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import grpc
import psycopg
from psycopg import sql

from services.common import settings_registry as registry
from services.common.config import Settings
from services.common.errors import KeelError
from services.common.setting import int_default, read_int

MAX_BLOB_BYTES = 64 << 20
DEFAULT_QUOTA_BLOBS = int_default(registry.KEEL_BLOB_QUOTA_COUNT)
DEFAULT_QUOTA_BYTES = int_default(registry.KEEL_BLOB_QUOTA_BYTES)
_BLOB_ID = re.compile(r"blob-[0-9a-f]{24}")
# Serializes the table's creation across processes sharing one schema.
_CREATE_LOCK_KEY = 4242
# With the tenant's hash: serializes one tenant's creates (its quota check
# and insert), on every edge replica.
_QUOTA_LOCK_CLASS = 4243


class BlobError(KeelError):
    """Root of every refusal of the blob store::

    BlobError               UNKNOWN              BLOB_ERROR
     ├── BlobNotFound       NOT_FOUND            BLOB_NOT_FOUND
     ├── InvalidBlobLength  INVALID_ARGUMENT     INVALID_BLOB_LENGTH
     ├── BlobQuotaExceeded  RESOURCE_EXHAUSTED   BLOB_QUOTA_EXCEEDED
     ├── WrongBlobOffset    FAILED_PRECONDITION  WRONG_BLOB_OFFSET
     ├── BlobIncomplete     FAILED_PRECONDITION  BLOB_INCOMPLETE
     └── ChunkPastLength    OUT_OF_RANGE         CHUNK_PAST_LENGTH
    """

    code = grpc.StatusCode.UNKNOWN
    reason = "BLOB_ERROR"


class BlobNotFound(BlobError):
    """No such blob for this tenant (including ids of a shape the store never makes)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "BLOB_NOT_FOUND"


class InvalidBlobLength(BlobError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_BLOB_LENGTH"


class BlobQuotaExceeded(BlobError):
    """The tenant's blobs would pass its quota (count or declared bytes)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "BLOB_QUOTA_EXCEEDED"


class WrongBlobOffset(BlobError):
    """The chunk was sent at another offset than the upload has reached."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "WRONG_BLOB_OFFSET"


class BlobIncomplete(BlobError):
    """The blob's bytes cannot be read before its last byte has arrived."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "BLOB_INCOMPLETE"


class ChunkPastLength(BlobError):
    """The chunk would make the blob longer than its declared length."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "CHUNK_PAST_LENGTH"


def is_blob_id(blob_id: object) -> bool:
    """Whether `blob_id` has the only shape the store makes (matched whole:
    no path, no trailing newline)."""
    return isinstance(blob_id, str) and _BLOB_ID.fullmatch(blob_id) is not None


def check_blob_id(blob_id: object) -> str:
    """`blob_id` if it has the only shape the store makes; else BlobNotFound."""
    if not is_blob_id(blob_id):
        raise BlobNotFound("no such blob")
    assert isinstance(blob_id, str)
    return blob_id


@dataclass(frozen=True)
class BlobQuota:
    """How much one tenant may store: blobs, and bytes as declared."""

    max_blobs: int = DEFAULT_QUOTA_BLOBS
    max_bytes: int = DEFAULT_QUOTA_BYTES

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BlobQuota:
        """`KEEL_BLOB_QUOTA_COUNT` and `KEEL_BLOB_QUOTA_BYTES` (defaults:
        10,000 blobs, 1 GiB)."""
        env = os.environ if env is None else env
        return cls(
            read_int(env, registry.KEEL_BLOB_QUOTA_COUNT),
            read_int(env, registry.KEEL_BLOB_QUOTA_BYTES),
        )

    def admit(self, held_blobs: int, held_bytes: int, length: int) -> None:
        """Refuses a new blob of `length` bytes beside what the tenant holds."""
        if held_blobs + 1 > self.max_blobs:
            raise BlobQuotaExceeded(
                f"this tenant holds {held_blobs} blobs, its quota is {self.max_blobs}",
                max_blobs=str(self.max_blobs),
            )
        if held_bytes + length > self.max_bytes:
            raise BlobQuotaExceeded(
                f"this tenant's blobs declare {held_bytes} bytes; {length} more would pass "
                f"its quota of {self.max_bytes}",
                max_bytes=str(self.max_bytes),
            )


def _not_found(blob_id: str) -> BlobNotFound:
    return BlobNotFound("no such blob", blob_id=blob_id)


@dataclass(frozen=True)
class BlobInfo:
    id: str
    tenant_id: str
    length: int
    offset: int
    content_type: str
    sha256: str

    @property
    def complete(self) -> bool:
        return self.offset == self.length

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "length": self.length,
            "offset": self.offset,
            "contentType": self.content_type,
            "complete": self.complete,
            "sha256": self.sha256 or None,
        }


class BlobStore(Protocol):
    """Blocking calls (file or database I/O): async callers use a thread."""

    def create(self, tenant_id: str, length: int, content_type: str) -> BlobInfo: ...

    def get(self, tenant_id: str, blob_id: str) -> BlobInfo: ...

    def append(self, tenant_id: str, blob_id: str, offset: int, chunk: bytes) -> BlobInfo: ...

    def read(self, tenant_id: str, blob_id: str) -> bytes:
        """The bytes of a complete blob (BlobIncomplete before the last byte)."""
        ...


def _check_length(length: int) -> None:
    if length <= 0 or length > MAX_BLOB_BYTES:
        raise InvalidBlobLength(f"length must be between 1 and {MAX_BLOB_BYTES} bytes")


def _check_chunk(info: BlobInfo, offset: int, chunk: bytes) -> None:
    if offset != info.offset:
        raise WrongBlobOffset(
            f"upload is at offset {info.offset}, not {offset}", offset=str(info.offset)
        )
    if info.offset + len(chunk) > info.length:
        raise ChunkPastLength("chunk goes past the declared length")


def _new_id() -> str:
    return f"blob-{secrets.token_hex(12)}"


class DiskBlobStore:
    """`<root>/<id>.json` (the BlobInfo) beside `<root>/<id>.bin` (the bytes).

    The blobs each tenant holds are counted once, from the files, then kept
    up to date by `create`: on disk (a one-process `keel up`) the edge of
    that process is the only one creating blobs."""

    def __init__(self, root: Path, quota: BlobQuota | None = None) -> None:
        self._root = root
        self._root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._quota = quota or BlobQuota()
        # tenant -> [blobs, declared bytes]; None until first needed.
        self._held: dict[str, list[int]] | None = None

    def _holdings(self) -> dict[str, list[int]]:
        if self._held is None:
            held: dict[str, list[int]] = {}
            for meta in self._root.glob("blob-*.json"):
                try:
                    info = BlobInfo(**json.loads(meta.read_text()))
                except (OSError, ValueError, TypeError):
                    continue
                counts = held.setdefault(info.tenant_id, [0, 0])
                counts[0] += 1
                counts[1] += info.length
            self._held = held
        return self._held

    def _meta(self, blob_id: str) -> Path:
        return self._root / f"{check_blob_id(blob_id)}.json"

    def _data(self, blob_id: str) -> Path:
        return self._root / f"{check_blob_id(blob_id)}.bin"

    def create(self, tenant_id: str, length: int, content_type: str) -> BlobInfo:
        _check_length(length)
        info = BlobInfo(_new_id(), tenant_id, length, 0, content_type, "")
        with self._lock:
            held = self._holdings().setdefault(tenant_id, [0, 0])
            self._quota.admit(held[0], held[1], length)
            self._data(info.id).write_bytes(b"")
            self._meta(info.id).write_text(json.dumps(asdict(info)))
            held[0] += 1
            held[1] += length
        return info

    def get(self, tenant_id: str, blob_id: str) -> BlobInfo:
        try:
            info = BlobInfo(**json.loads(self._meta(blob_id).read_text()))
        except (OSError, ValueError, TypeError):
            raise _not_found(blob_id) from None
        if info.tenant_id != tenant_id:
            raise _not_found(blob_id)
        return info

    def append(self, tenant_id: str, blob_id: str, offset: int, chunk: bytes) -> BlobInfo:
        with self._lock:
            info = self.get(tenant_id, blob_id)
            _check_chunk(info, offset, chunk)
            with self._data(blob_id).open("r+b") as handle:
                # Bytes past the recorded offset are a chunk whose metadata
                # never got written (a crash in between): the client sends it
                # again at the recorded offset, so it replaces them.
                handle.truncate(info.offset)
                handle.seek(info.offset)
                handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            new_offset = info.offset + len(chunk)
            digest = ""
            if new_offset == info.length:
                digest = hashlib.sha256(self._data(blob_id).read_bytes()).hexdigest()
            info = BlobInfo(**(asdict(info) | {"offset": new_offset, "sha256": digest}))
            temp = self._meta(blob_id).with_suffix(".tmp")
            temp.write_text(json.dumps(asdict(info)))
            temp.replace(self._meta(blob_id))
            return info

    def read(self, tenant_id: str, blob_id: str) -> bytes:
        info = self.get(tenant_id, blob_id)
        if not info.complete:
            raise BlobIncomplete(f"blob {blob_id} is not completely uploaded", blob_id=blob_id)
        with self._data(blob_id).open("rb") as handle:
            return handle.read(info.length)


_COLUMNS = "id, tenant_id, length, upload_offset, content_type, sha256"


class PostgresBlobStore:
    def __init__(self, settings: Settings, quota: BlobQuota | None = None) -> None:
        self._url = settings.database_url
        self._quota = quota or BlobQuota()
        # The table keeps the name it had when only the edge used it, so
        # existing deployments keep their uploads.
        self._table = sql.Identifier(settings.pg_schema, "edge_blobs")
        with psycopg.connect(self._url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(settings.pg_schema))
            )
            conn.execute("SELECT pg_advisory_lock(%s)", (_CREATE_LOCK_KEY,))
            try:
                conn.execute(
                    sql.SQL(
                        "CREATE TABLE IF NOT EXISTS {} (id text PRIMARY KEY,"
                        " tenant_id text NOT NULL,"
                        " length bigint NOT NULL, upload_offset bigint NOT NULL,"
                        " content_type text NOT NULL, sha256 text NOT NULL DEFAULT '',"
                        " data bytea NOT NULL DEFAULT ''::bytea)"
                    ).format(self._table)
                )
                # What a tenant holds is summed at every create.
                conn.execute(
                    sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (tenant_id, length)").format(
                        sql.Identifier("edge_blobs_tenant_id"), self._table
                    )
                )
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (_CREATE_LOCK_KEY,))

    @staticmethod
    def _info(row: tuple[object, ...] | None, tenant_id: str, blob_id: str) -> BlobInfo:
        if row is None or row[1] != tenant_id:
            raise _not_found(blob_id)
        found_id, tenant, length, offset, content_type, digest = row[:6]
        return BlobInfo(
            str(found_id),
            str(tenant),
            int(str(length)),
            int(str(offset)),
            str(content_type),
            str(digest),
        )

    def create(self, tenant_id: str, length: int, content_type: str) -> BlobInfo:
        _check_length(length)
        blob_id = _new_id()
        # One transaction: a refused create rolls back and leaves no row.
        with psycopg.connect(self._url) as conn:
            # Concurrent creates of one tenant (any replica) take turns, or
            # each would count the others' blobs as not there yet.
            conn.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_QUOTA_LOCK_CLASS, tenant_id)
            )
            held = conn.execute(
                sql.SQL(
                    "SELECT count(*), COALESCE(sum(length), 0) FROM {} WHERE tenant_id = %s"
                ).format(self._table),
                (tenant_id,),
            ).fetchone()
            assert held is not None
            self._quota.admit(int(held[0]), int(held[1]), length)
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (id, tenant_id, length, upload_offset, content_type)"
                    " VALUES (%s, %s, %s, 0, %s)"
                ).format(self._table),
                (blob_id, tenant_id, length, content_type),
            )
            conn.commit()
        return BlobInfo(blob_id, tenant_id, length, 0, content_type, "")

    def get(self, tenant_id: str, blob_id: str) -> BlobInfo:
        check_blob_id(blob_id)
        with psycopg.connect(self._url, autocommit=True) as conn:
            row = conn.execute(
                sql.SQL(f"SELECT {_COLUMNS} FROM {{}} WHERE id = %s").format(self._table),
                (blob_id,),
            ).fetchone()
        return self._info(row, tenant_id, blob_id)

    def append(self, tenant_id: str, blob_id: str, offset: int, chunk: bytes) -> BlobInfo:
        check_blob_id(blob_id)
        with psycopg.connect(self._url) as conn:
            row = conn.execute(
                sql.SQL(f"SELECT {_COLUMNS} FROM {{}} WHERE id = %s FOR UPDATE").format(
                    self._table
                ),
                (blob_id,),
            ).fetchone()
            info = self._info(row, tenant_id, blob_id)
            _check_chunk(info, offset, chunk)
            new_offset = info.offset + len(chunk)
            conn.execute(
                sql.SQL("UPDATE {} SET data = data || %s, upload_offset = %s WHERE id = %s").format(
                    self._table
                ),
                (chunk, new_offset, blob_id),
            )
            digest = ""
            if new_offset == info.length:
                data = conn.execute(
                    sql.SQL("SELECT data FROM {} WHERE id = %s").format(self._table), (blob_id,)
                ).fetchone()
                assert data is not None
                digest = hashlib.sha256(bytes(data[0])).hexdigest()
                conn.execute(
                    sql.SQL("UPDATE {} SET sha256 = %s WHERE id = %s").format(self._table),
                    (digest, blob_id),
                )
            conn.commit()
        return BlobInfo(**(asdict(info) | {"offset": new_offset, "sha256": digest}))

    def read(self, tenant_id: str, blob_id: str) -> bytes:
        check_blob_id(blob_id)
        with psycopg.connect(self._url, autocommit=True) as conn:
            row = conn.execute(
                sql.SQL(f"SELECT {_COLUMNS}, data FROM {{}} WHERE id = %s").format(self._table),
                (blob_id,),
            ).fetchone()
        info = self._info(row, tenant_id, blob_id)
        if not info.complete:
            raise BlobIncomplete(f"blob {blob_id} is not completely uploaded", blob_id=blob_id)
        assert row is not None
        return bytes(row[6])


def blob_store(settings: Settings, quota: BlobQuota | None = None) -> BlobStore:
    """The store every service of a deployment shares (blocking: it may
    create the table). Its quota applies to creates, which only the edge
    makes: by default the operator's `KEEL_BLOB_QUOTA_*`."""
    quota = quota or BlobQuota.from_env()
    if settings.uses_postgres:
        return PostgresBlobStore(settings, quota)
    return DiskBlobStore(Path(settings.data_dir) / "blobs", quota)
