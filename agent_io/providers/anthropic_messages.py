"""Anthropic's messages API, streamed through the official SDK.

Thinking blocks keep their signature (block field `signature`; a redacted
block is a thinking block with `redactedData`) so they can be sent back
verbatim on the next turn, as the API requires.

Tool names travel as wire names (tool_names.py) and come back as Keel's. A
tool call's arguments that are not a JSON object are kept as the model sent
them (`argumentsText`); `tool_use.input` must be an object, so such a call
is shown back with `{}` (its tool result says what was wrong).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from anthropic import (
    AnthropicError,
    APIConnectionError,
    APIStatusError,
    AsyncAnthropic,
    DefaultAsyncHttpxClient,
    omit,
)
from anthropic.types import MessageParam, RawContentBlockDelta, RawMessageStreamEvent
from anthropic.types.raw_content_block_start_event import ContentBlock

from agent_io.providers.base import (
    RATE_LIMIT_STATUSES,
    REDIRECT_STATUSES,
    Completed,
    ConfiguredModel,
    ContextOverflow,
    ModelRequest,
    ProviderError,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    Usage,
    redirect_refused,
    retry_after_ms,
    tool_call,
)
from agent_io.providers.tool_names import ToolNames
from compaction.policy import is_context_overflow
from services.common.secrets import OFFICIAL_BASE_URL

_STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "toolUse",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "pause_turn": "pauseTurn",
}
# The statuses the SDK itself would retry; the runner owns retries instead.
_RETRYABLE_STATUSES = frozenset({408, 409, 429})
# Error types that may arrive inside an accepted stream (HTTP status 200).
_RETRYABLE_TYPES = frozenset({"overloaded_error", "api_error", "rate_limit_error", "timeout_error"})
# Of those, the provider throttling (or out of capacity), not failing.
_RATE_LIMIT_TYPES = frozenset({"overloaded_error", "rate_limit_error"})
_EPHEMERAL = {"type": "ephemeral"}
# tool_use ids must match this; ids minted by another provider may not.
_TOOL_ID_INVALID = re.compile(r"[^a-zA-Z0-9_-]")


def tool_use_id(call_id: str) -> str:
    """A tool call id the API accepts (the same mapping for call and result)."""
    return _TOOL_ID_INVALID.sub("_", call_id)[:64] or "call"


def to_anthropic_messages(
    messages: Sequence[Mapping[str, Any]], names: ToolNames | None = None
) -> list[dict[str, Any]]:
    """Transcript messages as alternating user/assistant turns of blocks
    (tool names as `names` sends them; by default, as the messages' own
    names map)."""
    if names is None:
        names = ToolNames.for_messages(messages)
    converted: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if role == "assistant":
            wire_role, blocks = "assistant", _assistant_blocks(content, names)
        elif role == "toolResult":
            wire_role, blocks = "user", [_tool_result_block(message)]
        else:
            wire_role, blocks = "user", _user_blocks(content)
        if not blocks:
            continue
        # Consecutive same-role messages form one turn: all results of one
        # assistant message must travel in the single user turn after it.
        if converted and converted[-1]["role"] == wire_role:
            converted[-1]["content"].extend(blocks)
        else:
            converted.append({"role": wire_role, "content": blocks})
    # Mark the end of the conversation for the prompt cache: the next request
    # repeats this prefix, and a long session re-reads it at a tenth the cost.
    if converted and converted[-1]["content"][-1]["type"] not in ("thinking", "redacted_thinking"):
        converted[-1]["content"][-1]["cache_control"] = _EPHEMERAL
    return converted


def _user_blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    blocks: list[dict[str, Any]] = []
    for block in content or ():
        # The API rejects empty text blocks.
        if block.get("type") == "text" and block.get("text"):
            blocks.append({"type": "text", "text": block["text"]})
        elif block.get("type") == "image":
            source = {
                "type": "base64",
                "media_type": block.get("mimeType", "image/png"),
                "data": block.get("data", ""),
            }
            blocks.append({"type": "image", "source": source})
    return blocks


def _tool_result_block(message: Mapping[str, Any]) -> dict[str, Any]:
    block: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": tool_use_id(message.get("toolCallId", "")),
        "is_error": bool(message.get("isError", False)),
    }
    content = _user_blocks(message.get("content"))
    if content:
        block["content"] = content
    return block


def _assistant_blocks(content: Any, names: ToolNames) -> list[dict[str, Any]]:
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    blocks: list[dict[str, Any]] = []
    for block in content or ():
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            blocks.append({"type": "text", "text": block["text"]})
        elif kind == "thinking" and block.get("redactedData"):
            blocks.append({"type": "redacted_thinking", "data": block["redactedData"]})
        elif kind == "thinking" and block.get("signature"):
            thinking = block.get("thinking", "")
            blocks.append(
                {"type": "thinking", "thinking": thinking, "signature": block["signature"]}
            )
        elif kind == "toolCall":
            # Arguments that were not an object (a string: the model's own
            # malformed text) cannot be an `input`; the result explains.
            arguments = block.get("arguments")
            blocks.append(
                {
                    "type": "tool_use",
                    "id": tool_use_id(block.get("id", "")),
                    "name": names.wire(block.get("name", "")),
                    "input": arguments if isinstance(arguments, Mapping) else {},
                }
            )
        # Unsigned thinking (another model's) is dropped: the API refuses it.
    return blocks


@dataclass
class _Block:
    kind: str
    parts: list[str] = field(default_factory=list)
    signature: str = ""
    id: str = ""
    name: str = ""
    ordinal: int = 0  # position among the tool calls
    start_input: Any = None


@dataclass
class _Answer:
    """What the events have said so far (tool names already Keel's)."""

    model: str
    names: ToolNames
    blocks: dict[int, _Block] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)
    stop_reason: str | None = None
    message_id: str = ""

    def absorb(self, event: RawMessageStreamEvent) -> list[StreamEvent]:
        if event.type == "message_start":
            usage = event.message.usage
            self.model = event.message.model or self.model
            self.message_id = event.message.id
            self.usage = Usage(
                input=usage.input_tokens,
                output=usage.output_tokens,
                cache_read=usage.cache_read_input_tokens or 0,
                cache_write=usage.cache_creation_input_tokens or 0,
            )
        elif event.type == "message_delta":
            self.stop_reason = event.delta.stop_reason or self.stop_reason
            delta = event.usage
            # Counts in message_delta are cumulative; absent ones stay as they were.
            self.usage = Usage(
                input=_or(delta.input_tokens, self.usage.input),
                output=delta.output_tokens,
                cache_read=_or(delta.cache_read_input_tokens, self.usage.cache_read),
                cache_write=_or(delta.cache_creation_input_tokens, self.usage.cache_write),
            )
        elif event.type == "content_block_start":
            return self._start(event.index, event.content_block)
        elif event.type == "content_block_delta":
            return self._delta(self.blocks.get(event.index), event.delta)
        return []

    def _start(self, index: int, block: ContentBlock) -> list[StreamEvent]:
        if block.type == "tool_use":
            ordinal = sum(1 for known in self.blocks.values() if known.kind == "tool_use")
            name = self.names.keel(block.name)
            self.blocks[index] = _Block(
                "tool_use", id=block.id, name=name, ordinal=ordinal, start_input=block.input
            )
            return [ToolCallDelta(ordinal, block.id, name, "")]
        if block.type == "text":
            self.blocks[index] = _Block("text", [block.text])
            return [TextDelta(block.text)] if block.text else []
        if block.type == "thinking":
            self.blocks[index] = _Block("thinking", [block.thinking], signature=block.signature)
            return [ThinkingDelta(block.thinking)] if block.thinking else []
        if block.type == "redacted_thinking":
            self.blocks[index] = _Block("redacted_thinking", [block.data])
        # Server-side tool blocks are the API's own business; not kept.
        return []

    def _delta(self, block: _Block | None, delta: RawContentBlockDelta) -> list[StreamEvent]:
        if block is None:
            return []
        if delta.type == "text_delta":
            block.parts.append(delta.text)
            return [TextDelta(delta.text)]
        if delta.type == "thinking_delta":
            block.parts.append(delta.thinking)
            return [ThinkingDelta(delta.thinking)]
        if delta.type == "signature_delta":
            block.signature += delta.signature
        elif delta.type == "input_json_delta":
            block.parts.append(delta.partial_json)
            return [ToolCallDelta(block.ordinal, block.id, block.name, delta.partial_json)]
        return []

    def completed(self) -> Completed:
        if self.stop_reason is None:
            # A stream cut short must not be committed as a whole answer.
            raise ProviderError("the stream ended before the model finished", retryable=True)
        content: list[Mapping[str, Any]] = []
        calls: list[Mapping[str, Any]] = []
        for index in sorted(self.blocks):
            block = self.blocks[index]
            joined = "".join(block.parts)
            if block.kind == "text" and joined:
                content.append({"type": "text", "text": joined})
            elif block.kind == "thinking":
                thinking: dict[str, Any] = {"type": "thinking", "thinking": joined}
                if block.signature:
                    thinking["signature"] = block.signature
                content.append(thinking)
            elif block.kind == "redacted_thinking":
                content.append({"type": "thinking", "thinking": "", "redactedData": joined})
            elif block.kind == "tool_use":
                calls.append(_tool_use_call(block, joined))
        stop = _STOP_REASONS.get(self.stop_reason, self.stop_reason)
        extra: dict[str, Any] = {"messageId": self.message_id} if self.message_id else {}
        return Completed(tuple(content), tuple(calls), self.usage, stop, self.model, extra)


def _tool_use_call(block: _Block, streamed: str) -> dict[str, Any]:
    """A tool_use block as a call: its streamed input JSON, or, when none
    streamed, the input its start event carried (normally {})."""
    if streamed.strip() or block.start_input is None:
        return tool_call(block.id, block.name, streamed)
    if isinstance(block.start_input, dict):
        return {"id": block.id, "name": block.name, "arguments": block.start_input}
    return tool_call(block.id, block.name, json.dumps(block.start_input, ensure_ascii=False))


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def provider_error(exc: AnthropicError) -> ProviderError:
    """An SDK failure as the runner's error."""
    status = exc.status_code if isinstance(exc, APIStatusError) else 0
    if isinstance(exc, APIStatusError) and status in REDIRECT_STATUSES:
        return redirect_refused(status, exc.response.headers.get("location"))
    # An error event inside an accepted stream has the response's status (200).
    status = status if status >= 400 else 0
    message = str(exc)
    if is_context_overflow(message):
        return ContextOverflow(message, status=status)
    if isinstance(exc, APIStatusError):
        kind = str(exc.type)
        retryable = status in _RETRYABLE_STATUSES or status >= 500 or kind in _RETRYABLE_TYPES
        throttled = status in RATE_LIMIT_STATUSES or kind in _RATE_LIMIT_TYPES
        # The runner's retry honours the wait the provider asked for (an
        # error event inside an accepted stream has no headers of its own).
        wait = retry_after_ms(exc.response.headers) if status else None
        return ProviderError(
            message, retryable=retryable, status=status, rate_limited=throttled, retry_after_ms=wait
        )
    return ProviderError(message, retryable=isinstance(exc, APIConnectionError), status=status)


class AnthropicMessages(ConfiguredModel):
    """A `Provider` for the Anthropic messages protocol."""

    def __init__(
        self,
        *,
        model: str,
        api_key: str,
        base_url: str | None = None,
        context_window: int | None = None,
        max_output_tokens: int | None = None,
        thinking: Mapping[str, Any] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(model, context_window, max_output_tokens)
        self._thinking = dict(thinking) if thinking is not None else None
        self._client = AsyncAnthropic(
            api_key=api_key,
            # Explicit: None would make the SDK read ANTHROPIC_BASE_URL.
            base_url=base_url or OFFICIAL_BASE_URL["anthropic"],
            max_retries=0,
            timeout=timeout_s,
            # The SDK's client follows redirects; this one follows none
            # (base.REDIRECT_STATUSES says why). Closed with the SDK client.
            http_client=DefaultAsyncHttpxClient(follow_redirects=False),
        )
        # The SDK also sends ANTHROPIC_CUSTOM_HEADERS from the runner's
        # environment with every request: a call made for a tenant carries
        # what its loadout says, never the runner's other settings.
        self._client._custom_headers = {}

    @property
    def name(self) -> str:
        return "anthropic"

    async def aclose(self) -> None:
        await self._client.close()

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        budget = self.output_budget(request)
        names = ToolNames.for_request(request)
        system = (
            [{"type": "text", "text": request.system, "cache_control": _EPHEMERAL}]
            if request.system
            else omit
        )
        tools = [
            {
                "name": names.wire(tool.name),
                "description": tool.description,
                "input_schema": tool.parameters,
            }
            for tool in request.tools
        ]
        try:
            events = await self._client.messages.create(
                model=self._model,
                max_tokens=budget,
                messages=cast("list[MessageParam]", to_anthropic_messages(request.messages, names)),
                system=cast(Any, system),
                tools=cast(Any, tools) if tools else omit,
                thinking=cast(Any, self._thinking) if self._thinking is not None else omit,
                stream=True,
            )
        except AnthropicError as exc:
            raise provider_error(exc) from exc
        answer = _Answer(self._model, names)
        try:
            while True:
                # Only the SDK's own calls are guarded, so a bug in this module
                # surfaces as itself rather than as a provider error.
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
                except AnthropicError as exc:
                    raise provider_error(exc) from exc
                except Exception as exc:
                    # The SDK does not wrap transport faults that happen while
                    # the body streams (its HTTP library's own errors).
                    raise ProviderError(f"stream interrupted: {exc!r}", retryable=True) from exc
                for delta in answer.absorb(event):
                    yield delta
        finally:
            await events.close()
        yield answer.completed()
