"""An MCP `CallToolResult` as the `ToolOutcome` the model sees.

Text blocks are joined into the outcome's content; `structuredContent` is
kept as `structured` (and shown as JSON when the server sent no text);
images, audio and embedded binary resources are stored through a blob sink
and referenced by blob id, with a short note in the text so the model knows
they exist (the images themselves are shown to the model as image parts of
the result: `compaction.transcript` resolves the blob ids when it builds a
request); embedded text resources and resource links become text; the
server's `isError` is kept. Bytes the result claims to carry but cannot be
decoded make a malformed result: an error outcome.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from mcp_types import (
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from agent_io.tools.base import BlobSink, ToolOutcome

__all__ = ["BlobSink", "MalformedResult", "outcome_from_result"]


class MalformedResult(Exception):
    """A result whose parts cannot be read as the protocol says they should be."""


async def outcome_from_result(result: CallToolResult, sink: BlobSink | None) -> ToolOutcome:
    """Maps one result; raises `MalformedResult` for undecodable binary data."""
    parts: list[str] = []
    blobs: list[str] = []
    has_text = False
    for block in result.content:
        if isinstance(block, TextContent):
            has_text = True
            parts.append(block.text)
        elif isinstance(block, ImageContent | AudioContent):
            kind = "image" if isinstance(block, ImageContent) else "audio"
            data = _decode(block.data, kind)
            parts.append(await _stored_note(sink, data, block.mime_type, kind, blobs))
        elif isinstance(block, EmbeddedResource):
            parts.append(await _resource_text(block.resource, sink, blobs))
        elif isinstance(block, ResourceLink):
            parts.append(_link_text(block))
    structured = _structured(result.structured_content)
    if not has_text and result.structured_content is not None:
        # The model reads text only: without any, the structured value is the answer.
        parts.insert(0, json.dumps(result.structured_content, ensure_ascii=False))
    return ToolOutcome(
        content="\n".join(parts),
        is_error=result.is_error,
        structured=structured,
        blobs=tuple(blobs),
    )


def _structured(value: Any) -> Mapping[str, Any] | None:
    # Newer protocol versions allow any JSON value here; `ToolOutcome.structured`
    # holds objects only, so anything else reaches the model as text alone.
    return dict(value) if isinstance(value, Mapping) else None


def _decode(data: str, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MalformedResult(f"{what} data is not valid base64: {exc}") from None


async def _stored_note(
    sink: BlobSink | None, data: bytes, media_type: str, kind: str, blobs: list[str]
) -> str:
    size = f"{len(data)} bytes"
    if sink is None:
        return f"[{kind} {media_type}, {size}: not kept, this runner stores no blobs]"
    try:
        blob_id = await sink.store(data, media_type)
    except Exception as exc:  # the tool did run: the model learns what is missing
        return f"[{kind} {media_type}, {size}: could not be stored: {exc}]"
    blobs.append(blob_id)
    return f"[{kind} {media_type}, {size}, stored as blob {blob_id}]"


async def _resource_text(
    resource: TextResourceContents | BlobResourceContents,
    sink: BlobSink | None,
    blobs: list[str],
) -> str:
    media_type = resource.mime_type or "application/octet-stream"
    if isinstance(resource, TextResourceContents):
        kind = resource.mime_type or "text"
        return f"[resource {resource.uri} ({kind})]\n{resource.text}"
    data = _decode(resource.blob, f"resource {resource.uri}")
    return await _stored_note(sink, data, media_type, f"resource {resource.uri}", blobs)


def _link_text(link: ResourceLink) -> str:
    details = ", ".join(
        part
        for part in (
            link.mime_type,
            f"{link.size} bytes" if link.size is not None else None,
            link.description,
        )
        if part
    )
    suffix = f" ({details})" if details else ""
    return f"[resource link {link.name}: {link.uri}{suffix}]"
