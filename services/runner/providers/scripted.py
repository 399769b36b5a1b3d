"""The offline scripted model: deterministic answers, driven by the input.

Every path of the runner (streaming, tool calls, retries, overflow,
compaction) can be exercised without a network. The latest user message
decides the answer; a command at its start changes it:

    plain text                      "You said: <text>"
    /slow <seconds> <text>          that echo, streamed over ~<seconds>
    /tool <name> <json> [| ...]     tool calls, then "Tool <name> returned: ..."
    /fail                           a terminal ProviderError
    /fail <n> <text>                a retryable error while attempt <= n, then the echo
    /long <tokens>                  a reply of about <tokens> tokens
    /think <text>                   a thinking stream, then the echo

A request with purpose "summary" gets a structured checkpoint built from the
prompt, or fails when the prompt contains `/failsummary`.

Token counts are the compaction policy's estimates, so the usage this model
reports and the policy's own arithmetic agree exactly.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compaction.policy import estimate_text_tokens, message_from_dict
from compaction.policy.tokens import utf16_length
from services.runner.providers.base import (
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
from services.runner.providers.scripted_summary import cut, scripted_summary

DEFAULT_CONTEXT_WINDOW = 128_000
DEFAULT_MODEL_NAME = "scripted"
# When set, every request is appended to this file as one JSON line
# {system, messages, purpose}: tests compare what the model was really shown
# with what the ledger says a request presents.
RECORD_ENV = "KEEL_RECORD_REQUESTS"

# Word-ish tokens: each word with the whitespace after it (and a leading run of
# whitespace on its own), so the deltas concatenate back to the exact text.
_TOKEN_PATTERN = re.compile(r"\S+\s*|\s+")
_COMMAND_PATTERN = re.compile(r"(/[a-z]+)(?:\s+(.*))?", re.DOTALL)
_TOOL_NAME_PATTERN = re.compile(r"\s*([^\s|{\[]+)\s*")
# An instant model never awaits anything, so a long reply would hold the event
# loop for its whole stream; yielding every so often keeps lease renewal and
# other sessions running.
_YIELD_EVERY_TOKENS = 64
_LONG_VOCABULARY = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


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
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = json.dumps(
        {"system": request.system, "messages": list(request.messages), "purpose": request.purpose},
        ensure_ascii=False,
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, (line + "\n").encode())
    finally:
        os.close(descriptor)


def message_text(message: Mapping[str, Any]) -> str:
    """The text blocks of a message, joined (images and tool calls left out)."""
    content = message.get("content", "")
    if isinstance(content, str):
        return content
    texts = [block.get("text", "") for block in content if block.get("type") == "text"]
    return "\n".join(texts)


def tool_call_id(user_text: str, position: int, index: int) -> str:
    """A tool call id that only depends on the request, so a successor that
    re-runs the same context proposes the same calls (and the ledger can
    deduplicate them)."""
    digest = hashlib.sha256(f"{position}\x00{index}\x00{user_text}".encode()).hexdigest()
    return f"call_{digest[:24]}"


@dataclass(frozen=True)
class _Reply:
    text: str = ""
    thinking: str = ""
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    stop_reason: str = "stop"
    # Total streaming time (for /slow); None uses the per-token delay.
    seconds: float | None = None


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
            yield ToolCallDelta(index, call["id"], call["name"], json.dumps(call["arguments"]))

        content: list[Mapping[str, Any]] = []
        if reply.thinking:
            content.append({"type": "thinking", "thinking": reply.thinking})
        if reply.text:
            content.append({"type": "text", "text": reply.text})
        calls = [{"type": "toolCall", **call} for call in reply.tool_calls]
        output_tokens = message_from_dict({"role": "assistant", "content": content + calls}).tokens
        yield Completed(
            content=tuple(content),
            tool_calls=reply.tool_calls,
            usage=Usage(input=input_tokens, output=output_tokens),
            stop_reason=reply.stop_reason,
            model=self._model,
        )

    def _reply_for(self, request: ModelRequest) -> _Reply:
        if request.purpose == "summary":
            if any("/failsummary" in message_text(m) for m in request.messages):
                raise ProviderError("scripted summary failure", retryable=False)
            budget = self._output_budget(request)
            prompt = "\n\n".join(message_text(message) for message in request.messages)
            return _Reply(text=scripted_summary(prompt, budget))
        position, text = _latest_user_message(request.messages)
        match = _COMMAND_PATTERN.fullmatch(text.strip())
        if match is None:
            return _echo(text)
        command, rest = match.group(1), (match.group(2) or "").strip()
        if command == "/fail":
            return _fail(rest, request.attempt)
        if command == "/slow":
            seconds, _, said = rest.partition(" ")
            try:
                return _Reply(text=_echo(said).text, seconds=max(0.0, float(seconds)))
            except ValueError:
                return _echo(text)
        if command == "/long" and rest.isdigit():
            return _Reply(text=long_text(int(rest)))
        if command == "/think":
            return _Reply(
                thinking=f"The user wants this repeated back: {rest}. An echo answers that.",
                text=_echo(rest).text,
            )
        if command == "/tool":
            return _tool_reply(request.messages, position, text, rest)
        return _echo(text)

    def _output_budget(self, request: ModelRequest) -> int:
        if self._max_output_tokens is None:
            return request.max_output_tokens
        return min(request.max_output_tokens, self._max_output_tokens)

    def _fit_output(self, reply: _Reply, request: ModelRequest) -> _Reply:
        """Cut a text reply at the output budget, as a real model stops at
        max_tokens (stop reason "length")."""
        budget = self._output_budget(request)
        if reply.tool_calls or estimate_text_tokens(reply.thinking + reply.text) <= budget:
            return reply
        thinking = cut(reply.thinking, budget * 4)
        text = cut(reply.text, budget * 4 - utf16_length(thinking))
        return _Reply(text=text, thinking=thinking, stop_reason="length", seconds=reply.seconds)


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


def _latest_user_message(messages: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
    for position in range(len(messages) - 1, -1, -1):
        if messages[position].get("role") == "user":
            return position, message_text(messages[position])
    return -1, ""


def _echo(text: str) -> _Reply:
    return _Reply(text=f"You said: {text}")


def _fail(rest: str, attempt: int) -> _Reply:
    if not rest:
        raise ProviderError("scripted failure", retryable=False)
    count, _, text = rest.partition(" ")
    if not count.isdigit():
        raise ProviderError("scripted failure", retryable=False)
    if attempt <= int(count):
        # Retryable, or the runner would give up before the promised success.
        raise ProviderError(
            f"scripted failure (attempt {attempt} of {count} failing)", retryable=True, status=503
        )
    return _echo(text)


def long_text(tokens: int) -> str:
    """Deterministic prose of exactly `tokens` tokens by the policy estimate."""
    target = tokens * 4
    words: list[str] = []
    length = 0
    index = 0
    while length < target:
        word = _LONG_VOCABULARY[index % len(_LONG_VOCABULARY)]
        index += 1
        separator = ".\n" if index % 12 == 0 else " "
        words.append(word + separator)
        length += len(word) + len(separator)
    return "".join(words)[:target]


def parse_tool_calls(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """`name {json} | name {json} ...` → [(name, arguments)]; arguments default to {}."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, dict[str, Any]]] = []
    position = 0
    while True:
        match = _TOOL_NAME_PATTERN.match(spec, position)
        if match is None:
            raise ValueError(f"expected a tool name at offset {position}")
        name, position = match.group(1), match.end()
        arguments: Any = {}
        if position < len(spec) and spec[position] != "|":
            arguments, position = decoder.raw_decode(spec, position)
            if not isinstance(arguments, dict):
                raise ValueError(f"the arguments of {name} must be a JSON object")
        while position < len(spec) and spec[position].isspace():
            position += 1
        calls.append((name, arguments))
        if position >= len(spec):
            return calls
        if spec[position] != "|":
            raise ValueError(f"expected '|' between tool calls at offset {position}")
        position += 1


def _tool_reply(
    messages: Sequence[Mapping[str, Any]], position: int, user_text: str, spec: str
) -> _Reply:
    tail = messages[position + 1 :]
    results = [message for message in tail if message.get("role") == "toolResult"]
    if results:
        return _Reply(text=_report_results(tail, results))
    try:
        parsed = parse_tool_calls(spec)
    except ValueError as exc:
        return _Reply(text=f"I could not read that /tool command: {exc}")
    calls: tuple[Mapping[str, Any], ...] = tuple(
        {"id": tool_call_id(user_text, position, index), "name": name, "arguments": arguments}
        for index, (name, arguments) in enumerate(parsed)
    )
    names = ", ".join(name for name, _ in parsed)
    return _Reply(text=f"Calling {names}.", tool_calls=calls, stop_reason="toolUse")


def _report_results(tail: Sequence[Mapping[str, Any]], results: Sequence[Mapping[str, Any]]) -> str:
    # Pair results with the calls actually made (read back from the
    # transcript rather than recomputed: a compaction may have moved the
    # user message, and with it the ids this model would compute now).
    calls: dict[str, str] = {}
    for message in tail:
        if message.get("role") == "assistant" and not isinstance(message.get("content"), str):
            for block in message.get("content", ()):
                if block.get("type") == "toolCall":
                    calls[block.get("id", "")] = block.get("name", "")
    lines = []
    for result in results:
        call_id = result.get("toolCallId", "")
        name = calls.pop(call_id, None) or result.get("toolName", "tool")
        verb = "failed with" if result.get("isError") else "returned"
        lines.append(f"Tool {name} {verb}: {message_text(result)}")
    lines.extend(f"Tool {name} returned no result." for name in calls.values())
    return "\n".join(lines)
