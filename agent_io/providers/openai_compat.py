"""OpenAI-compatible chat completions, streamed through the official SDK.

Works with OpenAI itself and with servers that speak the same protocol
(vLLM, llama.cpp, Ollama, gateways) through `base_url`.

Tool names travel as wire names (tool_names.py) and come back as Keel's; a
tool call's arguments that are not a JSON object are kept as the model sent
them (`argumentsText`) and sent back verbatim in later requests.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from openai import (
    APIConnectionError,
    APIError,
    APIStatusError,
    AsyncOpenAI,
    DefaultAsyncHttpxClient,
    OpenAIError,
    omit,
)
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

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
    "stop": "stop",
    "tool_calls": "toolUse",
    "function_call": "toolUse",
    "length": "length",
}
# The statuses the SDK itself would retry: timeouts, lock conflicts, rate
# limits and server faults. The runner owns retries, so the SDK's are off.
_RETRYABLE_STATUSES = frozenset({408, 409, 429})
# Error codes of a rate limit, also inside an accepted stream (status 200).
_RATE_LIMIT_CODES = frozenset({"rate_limit_exceeded"})
_QUOTA_CODES = frozenset({"insufficient_quota"})
# Where OpenAI-compatible servers put reasoning text (DeepSeek, vLLM, OpenRouter).
_REASONING_FIELDS = ("reasoning_content", "reasoning")


def to_chat_messages(
    system: str, messages: Sequence[Mapping[str, Any]], names: ToolNames | None = None
) -> list[dict[str, Any]]:
    """Transcript messages in the chat-completions shape (tool names as
    `names` sends them; by default, as the messages' own names map)."""
    if names is None:
        names = ToolNames.for_messages(messages)
    converted: list[dict[str, Any]] = []
    if system:
        converted.append({"role": "system", "content": system})
    # Tool messages may carry text only, and must directly follow the call;
    # their images are shown in one user message after the run of results.
    pending_images: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role != "toolResult" and pending_images:
            converted.append({"role": "user", "content": pending_images})
            pending_images = []
        if role == "user":
            converted.append({"role": "user", "content": _user_content(message.get("content"))})
        elif role == "assistant":
            assistant = _assistant_message(message.get("content"), names)
            if assistant is not None:
                converted.append(assistant)
        elif role == "toolResult":
            text, images = _split_content(message.get("content"))
            if images:
                name = message.get("toolName", "the tool")
                pending_images.append({"type": "text", "text": f"Images returned by {name}:"})
                pending_images.extend(images)
            converted.append(
                {
                    "role": "tool",
                    "tool_call_id": message.get("toolCallId", ""),
                    "content": text or ("(see the images below)" if images else ""),
                }
            )
    if pending_images:
        converted.append({"role": "user", "content": pending_images})
    return converted


def _split_content(content: Any) -> tuple[str, list[dict[str, Any]]]:
    """Joined text and image parts of a user or tool-result content."""
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    for block in content or ():
        if block.get("type") == "text":
            texts.append(block.get("text", ""))
        elif block.get("type") == "image":
            images.append(_image_url(block))
    return "\n".join(texts), images


def _image_url(block: Mapping[str, Any]) -> dict[str, Any]:
    url = f"data:{block.get('mimeType', 'image/png')};base64,{block.get('data', '')}"
    return {"type": "image_url", "image_url": {"url": url}}


def _user_content(content: Any) -> str | list[dict[str, Any]]:
    text, images = _split_content(content)
    # A plain string where possible: some compatible servers reject part arrays.
    if not images:
        return text
    # With images, every part in its place: an input's text, then each
    # attachment (an image, or a file's text) in the order it was attached.
    parts: list[dict[str, Any]] = []
    for block in content:
        if block.get("type") == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif block.get("type") == "image":
            parts.append(_image_url(block))
    return parts


def _assistant_message(content: Any, names: ToolNames) -> dict[str, Any] | None:
    if isinstance(content, str):
        return {"role": "assistant", "content": content} if content else None
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content or ():
        if block.get("type") == "text":
            texts.append(block.get("text", ""))
        elif block.get("type") == "toolCall":
            arguments = block.get("arguments", {})
            # A string is what the model sent when it was not an object:
            # shown back exactly, not as the JSON encoding of a string.
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            function = {"name": names.wire(block.get("name", "")), "arguments": arguments}
            calls.append({"id": block.get("id", ""), "type": "function", "function": function})
        # Thinking is dropped: chat completions has no field to send it back in.
    text = "".join(texts)
    if not text and not calls:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass
class _ToolCall:
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class _Answer:
    """What the chunks have said so far (tool names already Keel's)."""

    model: str
    names: ToolNames
    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: dict[int, _ToolCall] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    response_id: str = ""

    def absorb(self, chunk: ChatCompletionChunk) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        self.model = chunk.model or self.model
        self.response_id = chunk.id or self.response_id
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
            # prompt_tokens includes the cached part; Keel counts it apart.
            self.usage = Usage(
                input=chunk.usage.prompt_tokens - cached,
                output=chunk.usage.completion_tokens,
                cache_read=cached,
            )
        for choice in chunk.choices[:1]:
            delta = choice.delta
            for key in _REASONING_FIELDS:
                reasoning = (delta.model_extra or {}).get(key)
                if isinstance(reasoning, str) and reasoning:
                    self.thinking.append(reasoning)
                    events.append(ThinkingDelta(reasoning))
            if delta.content:
                self.text.append(delta.content)
                events.append(TextDelta(delta.content))
            for part in delta.tool_calls or ():
                call = self.calls.setdefault(part.index, _ToolCall())
                call.id = call.id or part.id or ""
                fragment = ""
                if part.function is not None:
                    if not call.name and part.function.name:
                        call.name = self.names.keel(part.function.name)
                    fragment = part.function.arguments or ""
                    call.arguments += fragment
                events.append(ToolCallDelta(part.index, call.id, call.name, fragment))
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return events

    def completed(self) -> Completed:
        if self.finish_reason is None:
            # A stream cut short must not be committed as a whole answer.
            raise ProviderError("the stream ended before the model finished", retryable=True)
        content: list[Mapping[str, Any]] = []
        if self.thinking:
            content.append({"type": "thinking", "thinking": "".join(self.thinking)})
        if self.text:
            content.append({"type": "text", "text": "".join(self.text)})
        calls = [
            tool_call(self.calls[index].id, self.calls[index].name, self.calls[index].arguments)
            for index in sorted(self.calls)
        ]
        stop = _STOP_REASONS.get(self.finish_reason, self.finish_reason)
        if calls and stop == "stop":
            stop = "toolUse"  # some servers say "stop" after tool calls
        extra: dict[str, Any] = {"responseId": self.response_id} if self.response_id else {}
        return Completed(tuple(content), tuple(calls), self.usage, stop, self.model, extra)


def provider_error(exc: OpenAIError) -> ProviderError:
    """An SDK failure as the runner's error."""
    status = exc.status_code if isinstance(exc, APIStatusError) else 0
    if isinstance(exc, APIStatusError) and status in REDIRECT_STATUSES:
        return redirect_refused(status, exc.response.headers.get("location"))
    message = str(exc)
    code = exc.code if isinstance(exc, APIError) else None
    if code == "context_length_exceeded" or is_context_overflow(message):
        return ContextOverflow(message, status=status)
    wait = None
    if isinstance(exc, APIStatusError):
        retryable = status in _RETRYABLE_STATUSES or status >= 500
        # The runner's retry honours the wait the provider asked for.
        wait = retry_after_ms(exc.response.headers)
    else:
        # Connection faults and timeouts, and an error event inside a stream
        # the server had accepted (a bare APIError): both are worth a retry.
        # Anything else (a response that does not parse...) would fail again.
        retryable = isinstance(exc, APIConnectionError) or type(exc) is APIError
    throttled = status in RATE_LIMIT_STATUSES or code in _RATE_LIMIT_CODES
    if code in _QUOTA_CODES:
        # A 429 too, but the account is out of credit: no wait will fix it.
        retryable = throttled = False
    return ProviderError(
        message, retryable=retryable, status=status, rate_limited=throttled, retry_after_ms=wait
    )


class OpenAICompatible(ConfiguredModel):
    """A `Provider` for the chat-completions protocol."""

    def __init__(
        self,
        *,
        model: str,
        api_key: str,
        base_url: str | None = None,
        context_window: int | None = None,
        max_output_tokens: int | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(model, context_window, max_output_tokens)
        self._client = AsyncOpenAI(
            api_key=api_key,
            # Explicit: None would make the SDK read OPENAI_BASE_URL.
            base_url=base_url or OFFICIAL_BASE_URL["openai"],
            max_retries=0,
            timeout=timeout_s,
            # The SDK's client follows redirects; this one follows none
            # (base.REDIRECT_STATUSES says why). Closed with the SDK client.
            http_client=DefaultAsyncHttpxClient(follow_redirects=False),
        )
        # The SDK also applies OPENAI_ORG_ID, OPENAI_PROJECT_ID and
        # OPENAI_CUSTOM_HEADERS from the runner's environment to every
        # request: a call made for a tenant carries what its loadout says,
        # never the runner's other settings.
        self._client.organization = None
        self._client.project = None
        self._client._custom_headers = {}

    @property
    def name(self) -> str:
        return "openai"

    async def aclose(self) -> None:
        await self._client.close()

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        budget = self.output_budget(request)
        names = ToolNames.for_request(request)
        tools = [
            {
                "type": "function",
                "function": {
                    "name": names.wire(tool.name),
                    "description": tool.description,
                    "parameters": dict(tool.parameters),
                },
            }
            for tool in request.tools
        ]
        messages = to_chat_messages(request.system, request.messages, names)
        try:
            chunks = await self._client.chat.completions.create(
                model=self._model,
                messages=cast("list[ChatCompletionMessageParam]", messages),
                tools=cast(Any, tools) if tools else omit,
                max_completion_tokens=budget,
                stream=True,
                stream_options={"include_usage": True},
            )
        except OpenAIError as exc:
            raise provider_error(exc) from exc
        answer = _Answer(self._model, names)
        try:
            while True:
                # Only the SDK's own calls are guarded, so a bug in this module
                # surfaces as itself rather than as a provider error.
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except OpenAIError as exc:
                    raise provider_error(exc) from exc
                for event in answer.absorb(chunk):
                    yield event
        finally:
            await chunks.close()
        yield answer.completed()
