"""What an attempt (and a compaction) reads of a tenant's loadout document.

The kernel's schema (kernel.loadout) decides what may be written; this reads
an accepted document, with the defaults of fields left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Loadout"]


@dataclass(frozen=True)
class Loadout:
    """What an attempt needs from the tenant's loadout document."""

    revision: int
    system_prompt: str
    tool_names: tuple[str, ...]
    model: Mapping[str, Any]
    compaction: Mapping[str, Any]
    max_output_tokens: int

    @classmethod
    def from_document(cls, revision: int, document: Mapping[str, Any]) -> Loadout:
        model = document.get("model") or {"provider": "scripted", "name": "scripted-1"}
        tools = document.get("tools")
        if not isinstance(tools, list | tuple):
            tool_names: tuple[str, ...] = ("clock", "sleep", "counter")
        else:
            # `{source: builtin, names: [...]}` items, or plain built-in names
            # (older documents). Other sources (mcp, grpc) are refused by the
            # kernel's schema until the runner can call them.
            names: list[str] = []
            for item in tools:
                if isinstance(item, str):
                    names.append(item)
                elif isinstance(item, Mapping) and item.get("source") == "builtin":
                    names.extend(n for n in item.get("names") or () if isinstance(n, str))
            tool_names = tuple(dict.fromkeys(names))
        return cls(
            revision=revision,
            system_prompt=str(document.get("systemPrompt") or "You are a helpful assistant."),
            tool_names=tool_names,
            model=model,
            compaction=document.get("compaction") or {},
            max_output_tokens=int(model.get("maxOutputTokens") or 4096),
        )
