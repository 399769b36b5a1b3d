"""What a model is shown of a blob an input references.

- an image of a type the providers accept: an image part (base64);
- text (text/*, JSON, XML, YAML, ... that decodes as UTF-8): a text part
  headed by the blob's id and type;
- anything else, or a blob that cannot be found: a short text part saying
  what was attached. A model never receives raw bytes.

The runner (building requests) and the compaction service (answering "what
did the model see") resolve blobs with this one module, so the two agree.
Parts are a function of the blob alone and a complete blob never changes, so
resolving again, after a crash or on another process, gives the same parts:
a rebuilt request is the request a dead attempt sent.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from services.blobs import BlobIncomplete, BlobInfo, BlobNotFound, BlobStore

Part = dict[str, Any]
PartsResolver = Callable[[str], list[Part]]

# The image types OpenAI- and Anthropic-style APIs accept; another image type
# sent as an image part would fail the whole request.
IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
# Providers refuse larger images (Anthropic: 5 MB of base64 per image), and
# an image travels in every request of the session until a compaction drops
# it: 3.75 MB of bytes is 5,000,000 base64 characters.
MAX_IMAGE_BYTES = 3_750_000
# One upload must not crowd the conversation out of the context window: a
# 64 MB text file would be ~16M tokens. 100,000 characters is ~25k tokens by
# the compaction policy's estimate; the rest is cut, and the part says so.
MAX_TEXT_CHARS = 100_000
_TEXT_TYPES = frozenset(
    {
        "application/json",
        "application/x-ndjson",
        "application/xml",
        "application/yaml",
        "application/x-yaml",
        "application/toml",
        "application/javascript",
        "application/sql",
        "application/x-sh",
        "image/svg+xml",
    }
)
_TEXT_SUFFIXES = ("+json", "+xml", "+yaml")
# Parts kept in memory per resolver, by size (base64 or text characters).
DEFAULT_CACHED_CHARS = 64 << 20


def media_type(content_type: str) -> str:
    """`text/plain; charset=utf-8` -> `text/plain`."""
    return content_type.split(";", 1)[0].strip().lower()


def is_text_type(media: str) -> bool:
    return media.startswith("text/") or media in _TEXT_TYPES or media.endswith(_TEXT_SUFFIXES)


def _note(text: str) -> list[Part]:
    return [{"type": "text", "text": text}]


def unavailable_parts(blob_id: str) -> list[Part]:
    return _note(f"[Attachment {blob_id} is not available.]")


def _image_too_big(blob_id: str, media: str, size: int) -> list[Part]:
    return _note(
        f"[Attachment {blob_id}: a {media} image of {size} bytes, larger than "
        f"the {MAX_IMAGE_BYTES} bytes an image may have; it is not shown.]"
    )


def parts_of(info: BlobInfo, data: bytes) -> list[Part]:
    """The parts a model sees of the complete blob `info` with bytes `data`."""
    media = media_type(info.content_type)
    if media in IMAGE_TYPES:
        if len(data) > MAX_IMAGE_BYTES:
            return _image_too_big(info.id, media, len(data))
        return [{"type": "image", "data": base64.b64encode(data).decode(), "mimeType": media}]
    if is_text_type(media):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            pass
        else:
            shown = text[:MAX_TEXT_CHARS]
            if len(text) > MAX_TEXT_CHARS:
                shown += f"\n[Cut: the first {MAX_TEXT_CHARS} of {len(text)} characters are shown.]"
            return _note(f"Attachment {info.id} ({media}):\n{shown}")
    return _note(
        f"[Attachment {info.id}: binary content ({media or 'unknown type'}, "
        f"{len(data)} bytes) that cannot be shown.]"
    )


def _weight(parts: list[Part]) -> int:
    return sum(len(part.get("data") or part.get("text") or "") for part in parts)


class BlobContent:
    """Resolves blob ids to parts from `store`, keeping recent ones in memory.

    Resolving reads the store (blocking I/O). Async callers `prefetch` the ids
    they are about to present (in a thread); the synchronous resolver the
    transcript projection calls then finds them in memory.
    """

    def __init__(self, store: BlobStore, max_cached_chars: int = DEFAULT_CACHED_CHARS) -> None:
        self.store = store
        self._max_chars = max_cached_chars
        self._cache: OrderedDict[tuple[str, str], list[Part]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()

    def _cached(self, key: tuple[str, str]) -> list[Part] | None:
        with self._lock:
            parts = self._cache.get(key)
            if parts is not None:
                self._cache.move_to_end(key)
            return parts

    def _keep(self, key: tuple[str, str], parts: list[Part]) -> None:
        weight = _weight(parts)
        if weight > self._max_chars:
            return
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = parts
            self._cached_chars += weight
            while self._cached_chars > self._max_chars:
                _, dropped = self._cache.popitem(last=False)
                self._cached_chars -= _weight(dropped)

    def _load(self, tenant_id: str, blob_id: str) -> tuple[list[Part], bool]:
        """(parts, whether they may be cached). A transient store failure
        raises: a placeholder would make the request depend on luck."""
        try:
            info = self.store.get(tenant_id, blob_id)
            media = media_type(info.content_type)
            if info.complete and media in IMAGE_TYPES and info.length > MAX_IMAGE_BYTES:
                # Known from its length alone: spare reading megabytes.
                return _image_too_big(blob_id, media, info.length), True
            data = self.store.read(tenant_id, blob_id)
        except BlobNotFound:
            return unavailable_parts(blob_id), True
        except BlobIncomplete:
            # Inputs only reference complete blobs; should one not be, it may
            # still complete, so this answer is not remembered.
            return unavailable_parts(blob_id), False
        return parts_of(info, data), True

    def parts(self, tenant_id: str, blob_id: str) -> list[Part]:
        key = (tenant_id, blob_id)
        parts = self._cached(key)
        if parts is None:
            parts, cacheable = self._load(tenant_id, blob_id)
            if cacheable:
                self._keep(key, parts)
        # Copies: a caller may build on the list it gets.
        return [dict(part) for part in parts]

    def resolver(self, tenant_id: str) -> PartsResolver:
        """The projection's `blob_parts` for one tenant's sessions."""
        return lambda blob_id: self.parts(tenant_id, blob_id)

    async def prefetch(self, tenant_id: str, blob_ids: Iterable[str]) -> None:
        """Loads the ids not in memory yet, off the event loop."""
        missing = [b for b in dict.fromkeys(blob_ids) if self._cached((tenant_id, b)) is None]
        if missing:
            await asyncio.to_thread(lambda: [self.parts(tenant_id, b) for b in missing])


def blob_parts(store: BlobStore, tenant_id: str) -> PartsResolver:
    """A resolver for one tenant reading `store` on every call (no cache)."""
    return BlobContent(store, max_cached_chars=0).resolver(tenant_id)
