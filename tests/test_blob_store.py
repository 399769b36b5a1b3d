"""The blob store (disk and PostgreSQL) and what a model is shown of a blob."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from services.blob_parts import (
    MAX_IMAGE_BYTES,
    MAX_TEXT_CHARS,
    BlobContent,
    blob_parts,
    parts_of,
)
from services.blobs import (
    BlobIncomplete,
    BlobInfo,
    BlobNotFound,
    BlobStore,
    ChunkPastLength,
    DiskBlobStore,
    InvalidBlobLength,
    WrongBlobOffset,
    blob_store,
    check_blob_id,
)
from services.common.config import Settings
from tests.support.blobs import PNG

BAD_IDS = [
    "../../x",
    "../x",
    "blob-../../x",
    "/etc/passwd",
    "blob-0123456789abcdef0123456",  # 23 hex digits
    "blob-0123456789ABCDEF01234567",  # upper case: never made by the store
    "blob-0123456789abcdef01234567/../../x",
    "blob-0123456789abcdef01234567\n",
    "",
]


@pytest.fixture(params=["disk", "postgres"])
def store(request: pytest.FixtureRequest) -> BlobStore:
    name = "sqlite_settings" if request.param == "disk" else "pg_settings"
    settings: Settings = request.getfixturevalue(name)
    return blob_store(settings)


def upload(store: BlobStore, data: bytes, content_type: str, tenant: str = "t1") -> BlobInfo:
    info = store.create(tenant, len(data), content_type)
    return store.append(tenant, info.id, 0, data)


def test_an_upload_resumes_by_offset_and_reads_back(store: BlobStore) -> None:
    info = store.create("t1", 6, "text/plain")
    assert check_blob_id(info.id) == info.id
    with pytest.raises(BlobIncomplete):
        store.read("t1", info.id)
    store.append("t1", info.id, 0, b"abc")
    with pytest.raises(WrongBlobOffset, match="offset 3"):
        store.append("t1", info.id, 0, b"abc")
    with pytest.raises(ChunkPastLength):
        store.append("t1", info.id, 3, b"defg")
    done = store.append("t1", info.id, 3, b"def")
    assert done.complete and done.sha256
    assert store.read("t1", info.id) == b"abcdef"
    with pytest.raises(BlobNotFound):
        store.read("t2", info.id)  # another tenant's blob does not exist for it
    with pytest.raises(InvalidBlobLength):
        store.create("t1", 0, "text/plain")


@pytest.mark.parametrize("blob_id", BAD_IDS)
def test_ids_of_another_shape_are_not_found(store: BlobStore, blob_id: str) -> None:
    for call in (
        lambda: store.get("t1", blob_id),
        lambda: store.read("t1", blob_id),
        lambda: store.append("t1", blob_id, 0, b"x"),
    ):
        with pytest.raises(BlobNotFound):
            call()


def test_a_path_outside_the_store_is_never_read(sqlite_settings: Settings) -> None:
    store = blob_store(sqlite_settings)
    # A blob-looking pair of files one directory up: `../x` must not reach it.
    outside = Path(sqlite_settings.data_dir)
    meta = {"id": "x", "tenant_id": "t1", "length": 3, "offset": 3, "content_type": "text/plain"}
    (outside / "x.json").write_text(json.dumps(meta | {"sha256": ""}))
    (outside / "x.bin").write_bytes(b"top")
    with pytest.raises(BlobNotFound):
        store.read("t1", "../x")
    assert parts_of_store(store, "../x") == [
        {"type": "text", "text": "[Attachment ../x is not available.]"}
    ]


def parts_of_store(store: BlobStore, blob_id: str) -> list[dict[str, object]]:
    return blob_parts(store, "t1")(blob_id)


def test_a_chunk_left_by_a_crash_is_replaced_when_resent(tmp_path: Path) -> None:
    store = DiskBlobStore(tmp_path / "blobs")
    info = store.create("t1", 6, "text/plain")
    # The bytes of a chunk reached the file but its metadata never did.
    (tmp_path / "blobs" / f"{info.id}.bin").write_bytes(b"abc")
    store.append("t1", info.id, 0, b"abc")
    store.append("t1", info.id, 3, b"def")
    assert store.read("t1", info.id) == b"abcdef"


def info_of(content_type: str, length: int) -> BlobInfo:
    return BlobInfo("blob-" + "a" * 24, "t1", length, length, content_type, "")


def test_images_are_image_parts_and_text_is_text() -> None:
    assert parts_of(info_of("image/png", len(PNG)), PNG) == [
        {"type": "image", "data": base64.b64encode(PNG).decode(), "mimeType": "image/png"}
    ]
    (part,) = parts_of(info_of("text/markdown; charset=utf-8", 8), b"# notes\n")
    assert part == {
        "type": "text",
        "text": f"Attachment blob-{'a' * 24} (text/markdown):\n# notes\n",
    }
    for content_type in ("application/json", "application/vnd.api+json", "image/svg+xml"):
        (part,) = parts_of(info_of(content_type, 2), b"{}")
        assert part["type"] == "text" and part["text"].endswith(":\n{}")


@pytest.mark.parametrize(
    ("content_type", "data"),
    [
        ("application/octet-stream", b"\x00\x01\x02 raw"),
        ("application/pdf", b"%PDF-1.7 \xff\xfe"),
        ("text/plain", b"not utf-8 \xff\xfe\xfd"),
        ("image/tiff", b"II*\x00 tiff bytes"),
        ("", b"\x00"),
    ],
)
def test_other_content_is_described_never_sent(content_type: str, data: bytes) -> None:
    (part,) = parts_of(info_of(content_type, len(data)), data)
    assert part["type"] == "text"
    assert f"{len(data)} bytes" in part["text"] and "cannot be shown" in part["text"]
    assert data.decode("latin-1") not in part["text"]


def test_what_one_blob_may_inject_is_bounded() -> None:
    big_image = b"\x89PNG" + b"\x00" * MAX_IMAGE_BYTES
    (part,) = parts_of(info_of("image/png", len(big_image)), big_image)
    assert part["type"] == "text" and "not shown" in part["text"]
    text = "word " * (MAX_TEXT_CHARS // 2)
    (part,) = parts_of(info_of("text/plain", len(text)), text.encode())
    assert len(part["text"]) < MAX_TEXT_CHARS + 200
    assert part["text"].endswith(
        f"[Cut: the first {MAX_TEXT_CHARS} of {len(text)} characters are shown.]"
    )


def remove_files(directory: Path) -> None:
    for path in directory.iterdir():
        path.unlink()


async def test_prefetched_parts_are_served_from_memory(sqlite_settings: Settings) -> None:
    store = blob_store(sqlite_settings)
    image = upload(store, PNG, "image/png")
    notes = upload(store, b"remember the milk", "text/plain")
    content = BlobContent(store)
    await content.prefetch("t1", [image.id, notes.id, image.id])
    # Gone from disk: only memory can answer now.
    remove_files(Path(sqlite_settings.data_dir, "blobs"))
    resolve = content.resolver("t1")
    assert resolve(image.id)[0]["data"] == base64.b64encode(PNG).decode()
    assert resolve(notes.id)[0]["text"].endswith("remember the milk")
    assert resolve(image.id) == resolve(image.id)
    # Another tenant's resolver does not see this tenant's cached blobs.
    assert content.resolver("t2")(image.id)[0]["text"].endswith("is not available.]")
