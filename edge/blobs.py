"""Resumable blob uploads by offset.

Create with the total length, then append chunks, each sent with the offset
the client believes the upload has reached; a wrong offset is a 409 that
tells the real one, so a client that lost a response asks (HEAD) and resumes
instead of duplicating bytes. When the last byte arrives the blob is complete
and carries its SHA-256. Inputs reference blobs by id.

Embedded mode keeps blobs on disk; with PostgreSQL they live in a table, so
every edge replica sees every upload.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from edge.errors import BadRequest, Conflict, NotFound, PayloadTooLarge
from services.common.config import Settings

MAX_BLOB_BYTES = 64 << 20


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


def _check_length(length: int) -> None:
    if length <= 0 or length > MAX_BLOB_BYTES:
        raise BadRequest(f"length must be between 1 and {MAX_BLOB_BYTES} bytes")


class DiskBlobStore:
    def __init__(self, root: Path) -> None:
        self._root = root
        self._root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _meta(self, blob_id: str) -> Path:
        return self._root / f"{blob_id}.json"

    def _data(self, blob_id: str) -> Path:
        return self._root / f"{blob_id}.bin"

    def create(self, tenant_id: str, length: int, content_type: str) -> BlobInfo:
        _check_length(length)
        info = BlobInfo(f"blob-{secrets.token_hex(12)}", tenant_id, length, 0, content_type, "")
        with self._lock:
            self._data(info.id).write_bytes(b"")
            self._meta(info.id).write_text(json.dumps(asdict(info)))
        return info

    def get(self, tenant_id: str, blob_id: str) -> BlobInfo:
        try:
            info = BlobInfo(**json.loads(self._meta(blob_id).read_text()))
        except (OSError, ValueError, TypeError):
            raise NotFound("no such blob") from None
        if info.tenant_id != tenant_id:
            raise NotFound("no such blob")
        return info

    def append(self, tenant_id: str, blob_id: str, offset: int, chunk: bytes) -> BlobInfo:
        with self._lock:
            info = self.get(tenant_id, blob_id)
            if offset != info.offset:
                raise Conflict(f"upload is at offset {info.offset}, not {offset}")
            if info.offset + len(chunk) > info.length:
                raise PayloadTooLarge("chunk goes past the declared length")
            with self._data(blob_id).open("ab") as handle:
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


class PostgresBlobStore:
    def __init__(self, settings: Settings) -> None:
        self._url = settings.database_url
        self._table = sql.Identifier(settings.pg_schema, "edge_blobs")
        with psycopg.connect(self._url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(settings.pg_schema))
            )
            conn.execute("SELECT pg_advisory_lock(4242)")
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
            finally:
                conn.execute("SELECT pg_advisory_unlock(4242)")

    def _row(self, row: tuple[object, ...] | None, tenant_id: str) -> BlobInfo:
        if row is None or row[1] != tenant_id:
            raise NotFound("no such blob")
        blob_id, tenant, length, offset, content_type, digest = row
        return BlobInfo(
            str(blob_id),
            str(tenant),
            int(str(length)),
            int(str(offset)),
            str(content_type),
            str(digest),
        )

    def create(self, tenant_id: str, length: int, content_type: str) -> BlobInfo:
        _check_length(length)
        blob_id = f"blob-{secrets.token_hex(12)}"
        with psycopg.connect(self._url, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (id, tenant_id, length, upload_offset, content_type)"
                    " VALUES (%s, %s, %s, 0, %s)"
                ).format(self._table),
                (blob_id, tenant_id, length, content_type),
            )
        return BlobInfo(blob_id, tenant_id, length, 0, content_type, "")

    def get(self, tenant_id: str, blob_id: str) -> BlobInfo:
        with psycopg.connect(self._url, autocommit=True) as conn:
            row = conn.execute(
                sql.SQL(
                    "SELECT id, tenant_id, length, upload_offset, content_type, sha256"
                    " FROM {} WHERE id = %s"
                ).format(self._table),
                (blob_id,),
            ).fetchone()
        return self._row(row, tenant_id)

    def append(self, tenant_id: str, blob_id: str, offset: int, chunk: bytes) -> BlobInfo:
        with psycopg.connect(self._url) as conn:
            row = conn.execute(
                sql.SQL(
                    "SELECT id, tenant_id, length, upload_offset, content_type, sha256"
                    " FROM {} WHERE id = %s FOR UPDATE"
                ).format(self._table),
                (blob_id,),
            ).fetchone()
            info = self._row(row, tenant_id)
            if offset != info.offset:
                raise Conflict(f"upload is at offset {info.offset}, not {offset}")
            if info.offset + len(chunk) > info.length:
                raise PayloadTooLarge("chunk goes past the declared length")
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


BlobStore = DiskBlobStore | PostgresBlobStore


def blob_store(settings: Settings) -> BlobStore:
    if settings.uses_postgres:
        return PostgresBlobStore(settings)
    return DiskBlobStore(Path(settings.data_dir) / "blobs")
