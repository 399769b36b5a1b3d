"""Content blocks of a message, as frozen values.

The shapes are those of the context-entry JSON (pi's message content):
`{type: text, text}`, `{type: thinking, thinking}`,
`{type: toolCall, id, name, arguments}`, `{type: image, data, mimeType}`.
Fields the policy does not model (signatures, cache hints…) are kept in
`extra` and written back by `to_dict`, so a block survives the round trip to
a model request unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

Role: TypeAlias = Literal["user", "assistant", "toolResult"]
ROLES: tuple[Role, ...] = ("user", "assistant", "toolResult")

_NO_EXTRA: Mapping[str, object] = {}


def unmodelled_fields(raw: Mapping[str, object], modelled: frozenset[str]) -> Mapping[str, object]:
    """The members of `raw` whose keys are not in `modelled`."""
    if raw.keys() <= modelled:
        return _NO_EXTRA
    return {key: value for key, value in raw.items() if key not in modelled}


@dataclass(frozen=True, slots=True)
class TextBlock:
    text: str
    extra: Mapping[str, object] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, object]:
        return {**self.extra, "type": "text", "text": self.text}


@dataclass(frozen=True, slots=True)
class ThinkingBlock:
    thinking: str
    extra: Mapping[str, object] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, object]:
        return {**self.extra, "type": "thinking", "thinking": self.thinking}


@dataclass(frozen=True, slots=True)
class ToolCallBlock:
    id: str
    name: str
    # Whatever JSON the model produced; normally an object.
    arguments: object
    extra: Mapping[str, object] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, object]:
        return {
            **self.extra,
            "type": "toolCall",
            "id": self.id,
            "name": self.name,
            "arguments": self.arguments,
        }


@dataclass(frozen=True, slots=True)
class ImageBlock:
    data: str
    mime_type: str
    extra: Mapping[str, object] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, object]:
        return {**self.extra, "type": "image", "data": self.data, "mimeType": self.mime_type}


ContentBlock: TypeAlias = TextBlock | ThinkingBlock | ToolCallBlock | ImageBlock
# A message's content: a plain string or a sequence of blocks.
Content: TypeAlias = str | tuple[ContentBlock, ...]


def _text(raw: Mapping[str, object], key: str) -> str:
    value = raw.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"content block field {key!r} must be a string, got {value!r}")
    return value


_TEXT_FIELDS = frozenset({"type", "text"})
_THINKING_FIELDS = frozenset({"type", "thinking"})
_TOOL_CALL_FIELDS = frozenset({"type", "id", "name", "arguments"})
_IMAGE_FIELDS = frozenset({"type", "data", "mimeType"})


def block_from_dict(raw: Mapping[str, object]) -> ContentBlock:
    """Parse one content block; unknown block types are rejected."""
    kind = raw.get("type")
    if kind == "text":
        return TextBlock(_text(raw, "text"), unmodelled_fields(raw, _TEXT_FIELDS))
    if kind == "thinking":
        return ThinkingBlock(_text(raw, "thinking"), unmodelled_fields(raw, _THINKING_FIELDS))
    if kind == "toolCall":
        return ToolCallBlock(
            _text(raw, "id"),
            _text(raw, "name"),
            raw.get("arguments", {}),
            unmodelled_fields(raw, _TOOL_CALL_FIELDS),
        )
    if kind == "image":
        return ImageBlock(
            _text(raw, "data"), _text(raw, "mimeType"), unmodelled_fields(raw, _IMAGE_FIELDS)
        )
    raise ValueError(f"unknown content block type {kind!r}")


def content_from_json(raw: object) -> Content:
    """Parse a message's `content`: a string or a list of block dicts."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list | tuple):
        blocks: list[ContentBlock] = []
        for item in raw:
            if type(item) is not dict and not isinstance(item, Mapping):
                raise ValueError(f"content block must be an object, got {item!r}")
            blocks.append(block_from_dict(item))
        return tuple(blocks)
    raise ValueError(f"message content must be a string or a list of blocks, got {raw!r}")


def content_to_json(content: Content) -> str | list[dict[str, object]]:
    if isinstance(content, str):
        return content
    return [block.to_dict() for block in content]
