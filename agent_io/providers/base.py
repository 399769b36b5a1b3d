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

import email.utils
import json
import math
import time
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
    """A model call failed. `retryable` tells a transient fault from a terminal one.

    `rate_limited`: the provider is throttling (429, 529 overloaded), which
    is retryable but no fault of the session; `retry_after_ms`: how long the
    provider asked the caller to wait (None when it did not say).
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        status: int = 0,
        rate_limited: bool = False,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable or rate_limited
        self.status = status
        self.rate_limited = rate_limited
        self.retry_after_ms = retry_after_ms


# Statuses that mean "too many requests, or no capacity now": 429, and 529,
# Anthropic's overloaded (some OpenAI-compatible gateways use it too).
RATE_LIMIT_STATUSES = frozenset({429, 529})
# A longer wait than this in a header is taken as this (the kernel caps it
# further): a day is already no longer a retry.
_MAX_RETRY_AFTER_MS = 86_400_000


def retry_after_ms(headers: Mapping[str, str] | None, now: float | None = None) -> int | None:
    """The wait a response's headers ask for, in milliseconds, or None.

    `retry-after-ms` (OpenAI's, milliseconds) wins over `retry-after`
    (seconds, or an HTTP date). `headers` must look names up without regard
    to case, as httpx's do. A value that does not parse, or is negative, is
    no request to wait.
    """
    if headers is None:
        return None
    waited = _number(headers.get("retry-after-ms"))
    if waited is None:
        seconds = _number(headers.get("retry-after"))
        if seconds is None:
            seconds = _seconds_until(headers.get("retry-after"), now)
        waited = None if seconds is None else seconds * 1000
    if waited is None or waited < 0:
        return None
    return min(_MAX_RETRY_AFTER_MS, math.ceil(waited))


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _seconds_until(value: str | None, now: float | None) -> float | None:
    if not value:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


# The statuses of a redirect. A provider call follows none of them: the
# operator allowed the origin of `baseUrl` (KEEL_PROVIDER_ORIGINS), not
# wherever that origin points, and a 307 or 308 would resend the whole
# request, the tenant's conversation, to the new place.
REDIRECT_STATUSES = range(300, 400)


def redirect_refused(status: int, location: str | None) -> ProviderError:
    """The error of a provider call answered with a redirect (not followed).

    Not retryable: the same request gets the same answer until the loadout's
    `baseUrl` names where the model really is.
    """
    where = f" to {location}" if location else ""
    return ProviderError(
        f"the provider answered with a redirect ({status}){where}, which Keel does not "
        "follow: provider calls stay at the origin of the model's baseUrl; set baseUrl to "
        "the URL the model is served at",
        retryable=False,
        status=status,
    )


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
