"""Blobs for tests: real bytes in a real store, resolved as the model sees them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.blob_parts import blob_parts
from services.blobs import BlobStore, DiskBlobStore

# A complete 1x1 PNG.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
)


def store_blob(store: BlobStore, data: bytes, content_type: str, tenant: str = "t1") -> str:
    """Uploads `data` in one chunk; returns the blob id."""
    info = store.create(tenant, len(data), content_type)
    store.append(tenant, info.id, 0, data)
    return info.id


def attached(directory: Path, text: str, *blobs: tuple[bytes, str]) -> dict[str, Any]:
    """The user message of an input with `text` and these (bytes, content
    type) blobs, with the parts resolved from a disk store in `directory`."""
    store = DiskBlobStore(directory)
    resolve = blob_parts(store, "t1")
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for data, content_type in blobs:
        content.extend(resolve(store_blob(store, data, content_type)))
    return {"role": "user", "content": content}
