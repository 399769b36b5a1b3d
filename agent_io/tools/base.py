"""What every tool source speaks: specs, calls, outcomes, and the source protocol.

A tool call is at-least-once: a call committed without a result is executed
again by the successor of a crashed attempt. Each call therefore carries an
idempotency key, stable across attempts and unique per tenant, session and
call, and an effectful tool must use it (MCP servers get it in the request
`_meta` as `keel/idempotencyKey`, gRPC ToolServices in `idempotency_key`).

Every failure of a tool (timeout, a server gone, a malformed or oversized
result) is an outcome with `is_error` that the model sees, never an
exception out of this package; only cancellation propagates.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from agent_io.providers.base import ToolSpec

__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "DEFAULT_TOOL_TIMEOUT_S",
    "BlobSink",
    "ToolCall",
    "ToolOutcome",
    "ToolSource",
    "ToolSpec",
    "idempotency_key",
    "limit_result",
]

DEFAULT_TOOL_TIMEOUT_S = 60.0
# A result larger than this (UTF-8 bytes of its text) is cut, with a note
# saying so: a tool must not be able to fill the context window by itself.
DEFAULT_MAX_RESULT_BYTES = 64 * 1024


def idempotency_key(tenant_id: str, session_id: str, tool_call_id: str) -> str:
    """The key of one call: the same on every attempt of that call, and
    different for the same call id in another session or tenant (the offline
    model, and some real ones, reuse call ids across sessions)."""
    scope = "\x1f".join((tenant_id, session_id, tool_call_id))
    return "idem-" + hashlib.sha256(scope.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ToolCall:
    tool_call_id: str
    # The tool's name as the tool source knows it (no source prefix) once it
    # reaches a source; the registry receives the model's (prefixed) name.
    name: str
    arguments: Mapping[str, Any]
    idempotency_key: str
    session_id: str = ""
    tenant_id: str = ""


@dataclass(frozen=True)
class ToolOutcome:
    content: str
    is_error: bool = False
    # A tool's structured result (MCP `structuredContent`), kept as sent.
    structured: Mapping[str, Any] | None = None
    # Blob ids of images or resources the tool returned, stored as blobs.
    blobs: tuple[str, ...] = ()


class BlobSink(Protocol):
    """Where binary parts of a tool result go (images, embedded resources);
    returns the id of the stored blob."""

    async def store(self, data: bytes, media_type: str) -> str: ...


class ToolSource(Protocol):
    """One source of tools: the built-ins, an MCP server or a gRPC ToolService."""

    @property
    def name(self) -> str: ...

    async def list_tools(self) -> Sequence[ToolSpec]:
        """The source's tools, named without the source's prefix."""
        ...

    async def call(self, call: ToolCall, timeout_s: float) -> ToolOutcome:
        """Runs one call; a failure is an error outcome, never an exception."""
        ...

    async def aclose(self) -> None: ...


def limit_result(outcome: ToolOutcome, max_bytes: int) -> ToolOutcome:
    """The outcome within `max_bytes`: its text cut to that many UTF-8 bytes
    and a structured value over it dropped, each with a note. A cut result
    is an error result: the model must not take part of an answer for all
    of it."""
    raw = outcome.content.encode()
    structured = outcome.structured
    notes: list[str] = []
    if structured is not None:
        size = len(json.dumps(structured, ensure_ascii=False).encode())
        if size > max_bytes:
            structured = None
            notes.append(f"[structured result dropped: {size} bytes, the limit is {max_bytes}]")
    content = outcome.content
    if len(raw) > max_bytes:
        content = raw[:max_bytes].decode(errors="ignore")
        notes.append(f"[result truncated: {len(raw)} bytes, the limit is {max_bytes}]")
    if not notes:
        return outcome
    return replace(
        outcome,
        content="\n".join([content, *notes]),
        structured=structured,
        is_error=True,
    )
