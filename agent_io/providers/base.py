"""What the runner asks of a model provider, and what it gets back.

A request carries the messages a model is shown after the system prompt, in
the transcript's own shape (the same dicts the compaction policy reads):

    {"role": "user", "content": str | [blocks]}
    {"role": "assistant", "content": [text | thinking | toolCall blocks], "usage"?, "stopReason"?}
    {"role": "toolResult", "toolCallId": str, "toolName": str, "content": str | [blocks],
     "isError": bool}

Blocks: {"type": "text", "text"}, {"type": "thinking", "thinking"},
{"type": "toolCall", "id", "name", "arguments": {...} | str}, {"type": "image", "data", "mimeType"}.
A toolCall's `arguments` is a string when the model's arguments were not a
JSON object: the exact text it sent, shown back to it as it was.

A provider streams `TextDelta` / `ThinkingDelta` / `ToolCallDelta` events
(token-level partials, never facts) and ends with exactly one `Completed`,
or raises a `ProviderError`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias

Purpose: TypeAlias = Literal["turn", "summary"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    # JSON schema of the arguments object.
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class ModelRequest:
    system: str
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[ToolSpec, ...] = ()
    max_output_tokens: int = 4096
    # "turn": answer the conversation; "summary": write a compaction summary.
    purpose: Purpose = "turn"
    # 1 for the first attempt at this context, 2 for the first retry, ...
    attempt: int = 1
    # The compaction policy's token estimate of `messages`, when the caller
    # has it already (the runner does): spares re-parsing the whole context.
    messages_tokens: int | None = None
    # The id the answer will be committed under (`gen-<context head>`), so a
    # recorded request can be matched with the answer it produced ("" when
    # the request answers nothing, e.g. a summary).
    generation_id: str = ""


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ThinkingDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of a tool call being streamed (arguments arrive in pieces)."""

    index: int
    id: str
    name: str
    arguments_fragment: str


@dataclass(frozen=True)
class Usage:
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0

    @property
    def total(self) -> int:
        return self.input + self.output + self.cache_read + self.cache_write

    def to_dict(self) -> dict[str, int]:
        return {
            "input": self.input,
            "output": self.output,
            "cacheRead": self.cache_read,
            "cacheWrite": self.cache_write,
            "totalTokens": self.total,
        }


@dataclass(frozen=True)
class Completed:
    """The whole answer: what the runner commits as an `assistant` fact."""

    # Text and thinking blocks, in order (tool calls are in tool_calls).
    content: tuple[Mapping[str, Any], ...]
    # Each {"id", "name", "arguments": {...}}; when the text the model sent
    # as arguments is not a JSON object (malformed, or cut off by the output
    # limit), "arguments" is {} and "argumentsText" is that text, exactly:
    # such a call must not run (see `tool_call`).
    tool_calls: tuple[Mapping[str, Any], ...]
    usage: Usage
    # "stop", "toolUse", "length" (cut by the output limit), ...
    stop_reason: str
    model: str
    extra: Mapping[str, Any] = field(default_factory=dict)


StreamEvent: TypeAlias = TextDelta | ThinkingDelta | ToolCallDelta | Completed


def _not_json(constant: str) -> Any:
    # Python's parser accepts NaN and Infinity; JSON (and a ledger fact) does not.
    raise ValueError(f"{constant} is not JSON")


def tool_call(call_id: str, name: str, arguments_text: str) -> dict[str, Any]:
    """A `Completed.tool_calls` item from the arguments text the model sent.

    No text at all means no arguments ({}). Text that is not a JSON object is
    kept as `argumentsText` beside an empty `arguments`: running the tool
    with its defaults would run a call the model did not make.
    """
    call: dict[str, Any] = {"id": call_id, "name": name, "arguments": {}}
    if not arguments_text.strip():
        return call
    try:
        arguments = json.loads(arguments_text, parse_constant=_not_json)
    except ValueError:  # JSONDecodeError included
        arguments = None
    if isinstance(arguments, dict):
        call["arguments"] = arguments
    else:
        call["argumentsText"] = arguments_text
    return call


class ProviderError(Exception):
    """A model call failed. `retryable` tells a transient fault from a terminal one."""

    def __init__(self, message: str, *, retryable: bool = False, status: int = 0) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status


class ContextOverflow(ProviderError):
    """The request did not fit the model's context window."""


class ConfiguredModel:
    """What every provider is configured with: a model name, the window it
    declares (if any) and an optional cap on output tokens."""

    def __init__(
        self, model: str, context_window: int | None, max_output_tokens: int | None
    ) -> None:
        self._model = model
        self._context_window = context_window
        self._max_output_tokens = max_output_tokens

    @property
    def model(self) -> str:
        return self._model

    @property
    def context_window(self) -> int | None:
        return self._context_window

    def output_budget(self, request: ModelRequest) -> int:
        """The request's output budget, capped by the loadout's maxOutputTokens."""
        if self._max_output_tokens is None:
            return request.max_output_tokens
        return min(request.max_output_tokens, self._max_output_tokens)


class Provider(Protocol):
    """A model provider. Implementations: scripted (offline), openai, anthropic."""

    @property
    def name(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def context_window(self) -> int | None:
        """The model's declared window (wins over the tenant default), if known."""
        ...

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]: ...

    async def aclose(self) -> None: ...
