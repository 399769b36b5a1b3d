"""The offline scripted model: deterministic answers, driven by the input.

Every path of the runner (streaming, tool calls, retries, overflow,
compaction) can be exercised without a network. Every input the request
shows since the latest answer is acted on (scripted_batch.py says how); a
command at the start of an input changes what it contributes:

    plain text                      "You said: <text>"
    /slow <seconds> <text>          that echo, streamed over ~<seconds> (durations add up)
    /tool <name> <json> [| ...]     tool calls, then "Tool <name> returned: ..."
                                    (any tool name, `files.read` too; arguments
                                    that are not a JSON object are sent as
                                    written, as `argumentsText`)
    /fail                           a terminal ProviderError
    /fail <n> <text>                a retryable error while attempt <= n, then the echo
    /long <tokens>                  a reply of about <tokens> tokens
    /think <text>                   a thinking stream, then the echo

A request with purpose "summary" gets a structured checkpoint built from the
prompt; it fails when the prompt contains `/failsummary`, and streams over
~<seconds> when it contains `/slowsummary <seconds>` (so a client can watch
a compaction run).

Token counts are the compaction policy's estimates, so the usage this model
reports and the policy's own arithmetic agree exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from agent_io.providers.base import (
    Completed,
    ContextOverflow,
    ModelRequest,
    ProviderError,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    Usage,
)
from agent_io.providers.scripted_batch import (
    Reply,
    batch_reply,
    long_text,
    message_text,
    parse_tool_calls,
    tool_call_id,
)
from agent_io.providers.scripted_summary import cut, scripted_summary
from compaction.policy import estimate_text_tokens, message_from_dict
from compaction.policy.tokens import utf16_length
from services.common import settings_registry as registry
from services.common.setting import read_text

__all__ = [
    "DEFAULT_CONTEXT_WINDOW",
    "RECORD_ENV",
    "ScriptedModel",
    "estimate_request_tokens",
    "long_text",
    "message_text",
    "parse_tool_calls",
    "record_request",
    "split_tokens",
    "tool_call_id",
]

DEFAULT_CONTEXT_WINDOW = 128_000
DEFAULT_MODEL_NAME = "scripted"
# When set, every request is appended to this file as one JSON line
# {system, messages, purpose, generationId}: tests compare what the model was
# really shown with what the ledger says a request presents.
RECORD_ENV = registry.KEEL_RECORD_REQUESTS.name

# Word-ish tokens: each word with the whitespace after it (and a leading run of
# whitespace on its own), so the deltas concatenate back to the exact text.
_TOKEN_PATTERN = re.compile(r"\S+\s*|\s+")
_SLOW_SUMMARY = re.compile(r"/slowsummary\s+(\d+(?:\.\d*)?)")
# An instant model never awaits anything, so a long reply would hold the event
# loop for its whole stream; yielding every so often keeps lease renewal and
# other sessions running.
_YIELD_EVERY_TOKENS = 64


def split_tokens(text: str) -> list[str]:
    """`text` cut into word-ish tokens whose concatenation is `text`."""
    return _TOKEN_PATTERN.findall(text)


def estimate_request_tokens(request: ModelRequest) -> int:
    """The policy's estimate of what the request presents: system + messages."""
    messages = request.messages_tokens
    if messages is None:
        try:
            messages = sum(message_from_dict(message).tokens for message in request.messages)
        except ValueError as exc:
            raise ProviderError(f"scripted model cannot read the request: {exc}") from exc
    return estimate_text_tokens(request.system) + messages


def record_request(request: ModelRequest) -> None:
    """Appends `request` to $KEEL_RECORD_REQUESTS, if set (one write per line,
    so lines of concurrent requests never interleave)."""
    path = read_text(os.environ, registry.KEEL_RECORD_REQUESTS)
    if not path:
        return
    line = json.dumps(
        {
            "system": request.system,
            "messages": list(request.messages),
            "purpose": request.purpose,
            "generationId": request.generation_id,
        },
        ensure_ascii=False,
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, (line + "\n").encode())
    finally:
        os.close(descriptor)


class ScriptedModel:
    """A deterministic, offline `Provider`."""

    def __init__(
        self,
        *,
        model: str = DEFAULT_MODEL_NAME,
        context_window: int = DEFAULT_CONTEXT_WINDOW,
        token_delay_ms: int = 0,
        max_output_tokens: int | None = None,
    ) -> None:
        self._model = model
        self._context_window = context_window
        self._token_delay = token_delay_ms / 1000
        self._max_output_tokens = max_output_tokens

    @property
    def name(self) -> str:
        return "scripted"

    @property
    def model(self) -> str:
        return self._model

    @property
    def context_window(self) -> int:
        return self._context_window

    async def aclose(self) -> None:
        """Nothing to release: the model holds no connections."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        record_request(request)
        input_tokens = estimate_request_tokens(request)
        if input_tokens > self._context_window:
            raise ContextOverflow(
                f"input too long: the request needs about {input_tokens} tokens, which "
                f"exceeds the model's context window of {self._context_window} tokens",
                status=400,
            )
        reply = self._fit_output(self._reply_for(request), request)
        text_tokens = split_tokens(reply.text)
        thinking_tokens = split_tokens(reply.thinking)
        pacer = _Pacer(len(text_tokens) + len(thinking_tokens), reply.seconds, self._token_delay)
        for token in thinking_tokens:
            await pacer.wait()
            yield ThinkingDelta(token)
        for token in text_tokens:
            await pacer.wait()
            yield TextDelta(token)
        for index, call in enumerate(reply.tool_calls):
            yield ToolCallDelta(index, call["id"], call["name"], _arguments_text(call))

        content: list[Mapping[str, Any]] = []
        if reply.thinking:
            content.append({"type": "thinking", "thinking": reply.thinking})
        if reply.text:
            content.append({"type": "text", "text": reply.text})
        # Counted as the transcript will present them (raw text included).
        calls = [_tool_call_block(call) for call in reply.tool_calls]
        output_tokens = message_from_dict({"role": "assistant", "content": content + calls}).tokens
        yield Completed(
            content=tuple(content),
            tool_calls=reply.tool_calls,
            usage=Usage(input=input_tokens, output=output_tokens),
            stop_reason=reply.stop_reason,
            model=self._model,
        )

    def _reply_for(self, request: ModelRequest) -> Reply:
        if request.purpose != "summary":
            return batch_reply(request.messages, request.attempt)
        prompt = "\n\n".join(message_text(message) for message in request.messages)
        if "/failsummary" in prompt:
            raise ProviderError("scripted summary failure", retryable=False)
        slow = _SLOW_SUMMARY.search(prompt)
        return Reply(
            text=scripted_summary(prompt, self._output_budget(request)),
            seconds=float(slow.group(1)) if slow else None,
        )

    def _output_budget(self, request: ModelRequest) -> int:
        if self._max_output_tokens is None:
            return request.max_output_tokens
        return min(request.max_output_tokens, self._max_output_tokens)

    def _fit_output(self, reply: Reply, request: ModelRequest) -> Reply:
        """Cut a text reply at the output budget, as a real model stops at
        max_tokens (stop reason "length")."""
        budget = self._output_budget(request)
        if reply.tool_calls or estimate_text_tokens(reply.thinking + reply.text) <= budget:
            return reply
        thinking = cut(reply.thinking, budget * 4)
        text = cut(reply.text, budget * 4 - utf16_length(thinking))
        return Reply(text=text, thinking=thinking, stop_reason="length", seconds=reply.seconds)


def _arguments_text(call: Mapping[str, Any]) -> str:
    """The arguments as the model "wrote" them."""
    text = call.get("argumentsText")
    return text if isinstance(text, str) else json.dumps(call["arguments"])


def _tool_call_block(call: Mapping[str, Any]) -> dict[str, Any]:
    text = call.get("argumentsText")
    arguments = text if isinstance(text, str) else call["arguments"]
    return {"type": "toolCall", "id": call["id"], "name": call["name"], "arguments": arguments}


class _Pacer:
    """Sleeps between tokens: a fixed delay, or a schedule spreading the
    tokens over a total duration (without drift from sleep overshoot)."""

    def __init__(self, tokens: int, seconds: float | None, delay: float) -> None:
        self._count = 0
        self._step = (seconds / tokens if tokens else 0.0) if seconds is not None else delay
        self._start = asyncio.get_running_loop().time()

    async def wait(self) -> None:
        self._count += 1
        if self._step > 0:
            due = self._start + self._step * self._count
            await asyncio.sleep(max(0.0, due - asyncio.get_running_loop().time()))
        elif self._count % _YIELD_EVERY_TOKENS == 0:
            await asyncio.sleep(0)
