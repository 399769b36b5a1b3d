"""What an attempt (and a compaction) reads of a tenant's loadout document.

The kernel's schema (kernel.loadout) decides what may be written; this reads
an accepted document, with the defaults of fields left out. It is lenient
where the schema is strict: a document stored before a rule existed is read
as well as it can be (an item it cannot use is skipped, a built-in named
twice keeps its first settings), never refused here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUILTIN_SOURCE", "DEFAULT_BUILTINS", "Loadout", "ToolSourceItem", "tool_sources"]

# The name of the built-ins' source; its tools are not prefixed.
BUILTIN_SOURCE = "builtin"
# What a loadout without `tools` enables: every built-in (agent_io.tools.builtin;
# tests/tools/test_registry.py pins that the two agree).
DEFAULT_BUILTINS = ("clock", "sleep", "counter")


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(item for item in value if isinstance(item, str))


def _string_map(value: Any) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, str)}


def _positive(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


@dataclass(frozen=True)
class ToolSourceItem:
    """One item of the loadout's `tools`: a source of tools and its settings.

    Secrets stay names here (`env`, `headers_env` map to the runner's
    variables); the runner resolves them under the operator's policy when
    it builds the source.
    """

    source: str  # builtin, mcp or grpc
    # The prefix of its tools (`files` → `files.read`); BUILTIN_SOURCE for built-ins.
    name: str
    # Built-ins: the tools this item enables.
    names: tuple[str, ...] = ()
    # mcp: stdio or http.
    transport: str = ""
    command: tuple[str, ...] = ()
    # The child's variable -> the runner's variable whose value it gets.
    env: Mapping[str, str] = field(default_factory=dict)
    url: str = ""
    # HTTP header -> the runner's variable holding its value.
    headers_env: Mapping[str, str] = field(default_factory=dict)
    # grpc: host:port or grpcs://host:port.
    target: str = ""
    # The tools (their own names, no prefix) a person must approve first.
    require_approval: frozenset[str] = frozenset()
    # None: the runner's defaults.
    timeout_ms: int | None = None
    max_result_bytes: int | None = None

    @property
    def prefixed(self) -> bool:
        """Whether the model sees this source's tools as `<name>.<tool>`."""
        return self.source != BUILTIN_SOURCE

    @classmethod
    def builtins(cls, names: tuple[str, ...]) -> ToolSourceItem:
        return cls(BUILTIN_SOURCE, BUILTIN_SOURCE, names=names)

    @classmethod
    def from_item(cls, item: Any) -> ToolSourceItem | None:
        """The item as written (a built-in's name or a source object); None
        for what no runner can use."""
        if isinstance(item, str):
            return cls.builtins((item,))
        if not isinstance(item, Mapping):
            return None
        source = item.get("source")
        common: dict[str, Any] = {
            "require_approval": frozenset(_strings(item.get("requireApproval"))),
            "timeout_ms": _positive(item.get("timeoutMs")),
            "max_result_bytes": _positive(item.get("maxResultBytes")),
        }
        if source == BUILTIN_SOURCE:
            return cls(BUILTIN_SOURCE, BUILTIN_SOURCE, names=_strings(item.get("names")), **common)
        name = item.get("name")
        if not isinstance(name, str) or not name:
            return None
        if source == "mcp":
            return cls(
                "mcp",
                name,
                transport=str(item.get("transport") or ""),
                command=_strings(item.get("command")),
                env=_string_map(item.get("env")),
                url=str(item.get("url") or ""),
                headers_env=_string_map(item.get("headersEnv")),
                **common,
            )
        if source == "grpc":
            return cls("grpc", name, target=str(item.get("target") or ""), **common)
        return None


def tool_sources(tools: Any) -> tuple[ToolSourceItem, ...]:
    """The loadout's `tools` as items; every built-in when it sets none."""
    if not isinstance(tools, list | tuple):
        return (ToolSourceItem.builtins(DEFAULT_BUILTINS),)
    items = (ToolSourceItem.from_item(item) for item in tools)
    return tuple(item for item in items if item is not None)


@dataclass(frozen=True)
class Loadout:
    """What an attempt needs from the tenant's loadout document."""

    revision: int
    system_prompt: str
    # In the document's order; the first source to offer a name keeps it.
    tool_sources: tuple[ToolSourceItem, ...]
    model: Mapping[str, Any]
    compaction: Mapping[str, Any]
    max_output_tokens: int

    @classmethod
    def from_document(cls, revision: int, document: Mapping[str, Any]) -> Loadout:
        model = document.get("model") or {"provider": "scripted", "name": "scripted-1"}
        return cls(
            revision=revision,
            system_prompt=str(document.get("systemPrompt") or "You are a helpful assistant."),
            tool_sources=tool_sources(document.get("tools")),
            model=model,
            compaction=document.get("compaction") or {},
            max_output_tokens=int(model.get("maxOutputTokens") or 4096),
        )
