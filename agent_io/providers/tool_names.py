"""Tool names as the model APIs accept them, and back.

Keel names a source's tools `<source>.<tool>` (`files.read`), and an MCP
server's own tool names may hold dots, slashes or anything else. OpenAI
function names and Anthropic tool names must match `^[a-zA-Z0-9_-]{1,64}$`,
so each adapter sends every tool name of a request (its tools, and the tool
calls its history presents) under a wire name, and reads the model's calls
back under Keel's names.

The mapping is a function of the set of names a request holds:

- a name the APIs already accept is sent unchanged (most built-ins);
- any other name is sent with each refused character replaced by `_`
  (`files.read` -> `files_read`), when no other name of the request is sent
  or would be sent under that form and it fits in 64 characters;
- otherwise it is cut and given a digest of the whole name
  (`<prefix>_<8 hex>`), so two names never share a wire name.

Names are mapped in sorted order, so the same tools always get the same wire
names, whatever order the loadout lists them in; a request's history uses
the same mapping as its tools, so the model sees one name per tool.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

from agent_io.providers.base import ModelRequest

__all__ = ["MAX_WIRE_NAME", "ToolNames", "is_wire_safe"]

MAX_WIRE_NAME = 64
_WIRE_SAFE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_REFUSED_CHAR = re.compile(r"[^a-zA-Z0-9_-]")
_DIGEST_CHARS = 8


def is_wire_safe(name: str) -> bool:
    """Whether the OpenAI and Anthropic APIs accept `name` as a tool name."""
    return _WIRE_SAFE.fullmatch(name) is not None


def _readable(name: str) -> str:
    return _REFUSED_CHAR.sub("_", name)


def _digested(name: str, attempt: int) -> str:
    """`name` cut to fit, with a digest of the whole name (and of `attempt`,
    past the first, should that form be taken already)."""
    seed = name if attempt == 0 else f"{name}\x00{attempt}"
    digest = hashlib.sha256(seed.encode()).hexdigest()[:_DIGEST_CHARS]
    prefix = _readable(name)[: MAX_WIRE_NAME - _DIGEST_CHARS - 1] or "tool"
    return f"{prefix}_{digest}"


def history_tool_names(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The tool names of every tool call the messages present."""
    names: list[str] = []
    for message in messages:
        content = message.get("content")
        if message.get("role") != "assistant" or isinstance(content, str):
            continue
        for block in content or ():
            name = block.get("name") if block.get("type") == "toolCall" else None
            if isinstance(name, str):
                names.append(name)
    return names


@dataclass(frozen=True)
class ToolNames:
    """Keel tool name <-> wire name, for the names of one request."""

    to_wire: Mapping[str, str]
    to_keel: Mapping[str, str]

    @classmethod
    def of(cls, names: Iterable[str]) -> ToolNames:
        unique = sorted(set(names))
        to_wire = {name: name for name in unique if is_wire_safe(name)}
        taken = set(to_wire)
        others = [name for name in unique if name not in to_wire]
        # The readable form, where exactly one name wants it: two names that
        # read the same (`a.b`, `a/b`) both get digests, so neither depends
        # on the other's presence.
        wanted: dict[str, list[str]] = {}
        for name in others:
            wanted.setdefault(_readable(name), []).append(name)
        for readable, owners in sorted(wanted.items()):
            if len(owners) == 1 and readable not in taken and is_wire_safe(readable):
                to_wire[owners[0]] = readable
                taken.add(readable)
        for name in others:
            if name in to_wire:
                continue
            wire = next(
                form for attempt in count() if (form := _digested(name, attempt)) not in taken
            )
            to_wire[name] = wire
            taken.add(wire)
        return cls(to_wire, {wire: name for name, wire in to_wire.items()})

    @classmethod
    def for_messages(cls, messages: Sequence[Mapping[str, Any]]) -> ToolNames:
        return cls.of(history_tool_names(messages))

    @classmethod
    def for_request(cls, request: ModelRequest) -> ToolNames:
        tools = [tool.name for tool in request.tools]
        return cls.of(tools + history_tool_names(request.messages))

    def wire(self, name: str) -> str:
        """The name `name` is sent under."""
        known = self.to_wire.get(name)
        if known is not None:
            return known
        # Not one of the request's names: still sent as the APIs accept it.
        return name if is_wire_safe(name) else _digested(name, 0)

    def keel(self, wire_name: str) -> str:
        """The Keel name of a tool the model called by `wire_name` (a name the
        request never sent comes back as it is, for the registry to refuse)."""
        return self.to_keel.get(wire_name, wire_name)
