"""How the scripted model reads a turn request: it acts on every input shown.

Inputs that arrive while an attempt runs are answered together by the next
request, so a request may end with several user messages. The model reads
the current EXCHANGE: everything after the latest final answer (an assistant
message without tool calls). Its user messages are the batch; its assistant
messages (tool calls) and tool results are the batch's tool rounds.

- Inputs not yet followed by a tool round are pending: every `/tool` among
  them issues its calls (all in one assistant message), `/slow` durations add
  up, a `/fail` fails the request.
- With nothing left to call, the final answer gives every input's part in
  order (echoes, `/long` prose, `/think` thoughts) and then every result of
  the exchange.

Tool call ids are a function of the request alone (every message before the
input, the input's text, the call's index), so a successor rebuilding the
same context proposes the same ids, and an input repeated later in the
session (even where a compaction moved it to an earlier position) gets new
ones: the ledger deduplicates by tool call id, so a repeat must not collide.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_io.providers.base import ProviderError
from compaction.policy.context import SUMMARY_INTRO

_COMMAND_PATTERN = re.compile(r"(/[a-z]+)(?:\s+(.*))?", re.DOTALL)
_TOOL_NAME_PATTERN = re.compile(r"\s*([^\s|{\[]+)\s*")
_LONG_VOCABULARY = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


@dataclass(frozen=True)
class Reply:
    text: str = ""
    thinking: str = ""
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    stop_reason: str = "stop"
    # Total streaming time (for /slow); None uses the per-token delay.
    seconds: float | None = None


def message_text(message: Mapping[str, Any]) -> str:
    """The text blocks of a message, joined (images and tool calls left out)."""
    content = message.get("content", "")
    if isinstance(content, str):
        return content
    texts = [block.get("text", "") for block in content if block.get("type") == "text"]
    return "\n".join(texts)


def tool_call_id(user_text: str, position: int, index: int, history: str = "") -> str:
    """A tool call id that only depends on the request (`history` is a digest
    of the messages before the input, which is at `position`)."""
    seed = f"{history}\x00{position}\x00{index}\x00{user_text}"
    return f"call_{hashlib.sha256(seed.encode()).hexdigest()[:24]}"


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


@dataclass(frozen=True)
class ScriptedCall:
    """One call a `/tool` command asks for."""

    # Any registered tool's name, prefixed ones too (`files.read`).
    name: str
    arguments: Mapping[str, Any]
    # Set when the arguments are not a JSON object: the text, as written.
    arguments_text: str | None = None

    def with_id(self, call_id: str) -> dict[str, Any]:
        """The call as a `Completed.tool_calls` item."""
        call: dict[str, Any] = {"id": call_id, "name": self.name, "arguments": dict(self.arguments)}
        if self.arguments_text is not None:
            call["argumentsText"] = self.arguments_text
        return call


def parse_tool_calls(spec: str) -> list[ScriptedCall]:
    """`name {json} | name {json} ...` → the calls; arguments default to {}.

    Arguments that are not a JSON object (`clock {"tz": `, `clock [1]`) make
    a call carrying that text as written, as a real model's malformed or
    cut-off arguments would: such a call is the command's last, its text
    running to the end of the command (where a malformed object ends cannot
    be known).
    """
    decoder = json.JSONDecoder()
    calls: list[ScriptedCall] = []
    position = 0
    while True:
        match = _TOOL_NAME_PATTERN.match(spec, position)
        if match is None:
            raise ValueError(f"expected a tool name at offset {position}")
        name, position = match.group(1), match.end()
        arguments: Any = {}
        if position < len(spec) and spec[position] != "|":
            try:
                arguments, end = decoder.raw_decode(spec, position)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                calls.append(ScriptedCall(name, {}, spec[position:].rstrip()))
                return calls
            position = end
        while position < len(spec) and spec[position].isspace():
            position += 1
        calls.append(ScriptedCall(name, arguments))
        if position >= len(spec):
            return calls
        if spec[position] != "|":
            raise ValueError(f"expected '|' between tool calls at offset {position}")
        position += 1


@dataclass(frozen=True)
class _Input:
    """One user message of the exchange."""

    position: int
    # The input's own text (its first text part); later parts are attachments.
    text: str
    attachments: tuple[Mapping[str, Any], ...]
    # A tool round followed it: its calls (if any) were issued.
    handled: bool


@dataclass
class _Effect:
    """What one input contributes to the reply."""

    text: str = ""
    thinking: str = ""
    calls: list[ScriptedCall] = field(default_factory=list)
    # How long `/slow` asks the stream to take.
    seconds: float | None = None


def _split_user(message: Mapping[str, Any]) -> tuple[str, tuple[Mapping[str, Any], ...]]:
    content = message.get("content", "")
    if isinstance(content, str):
        return content, ()
    blocks = list(content)
    first = next((i for i, b in enumerate(blocks) if b.get("type") == "text"), None)
    if first is None:
        return "", tuple(blocks)
    return blocks[first].get("text", ""), tuple(blocks[:first] + blocks[first + 1 :])


def _has_tool_calls(message: Mapping[str, Any]) -> bool:
    content = message.get("content")
    return not isinstance(content, str) and any(
        block.get("type") == "toolCall" for block in content or ()
    )


def _exchange_start(messages: Sequence[Mapping[str, Any]]) -> int:
    for position in range(len(messages) - 1, -1, -1):
        message = messages[position]
        if message.get("role") == "assistant" and not _has_tool_calls(message):
            return position + 1
    return 0


def _echo(text: str, attachments: Sequence[Mapping[str, Any]] = ()) -> str:
    echo = f"You said: {text}"
    images = sum(1 for part in attachments if part.get("type") == "image")
    texts = len(attachments) - images
    if attachments:
        echo += f"\nAttachments: {images} image(s), {texts} text part(s)."
    return echo


def _fail(rest: str, attempt: int) -> str:
    """Raises as `/fail` asks on this attempt; else the text to echo."""
    count, _, text = rest.partition(" ")
    if not rest or not count.isdigit():
        raise ProviderError("scripted failure", retryable=False)
    if attempt <= int(count):
        # Retryable, or the runner would give up before the promised success.
        raise ProviderError(
            f"scripted failure (attempt {attempt} of {count} failing)", retryable=True, status=503
        )
    return text


def _effect(item: _Input, attempt: int) -> _Effect:
    text = item.text
    match = _COMMAND_PATTERN.fullmatch(text.strip())
    if match is None:
        return _Effect(text=_echo(text, item.attachments))
    command, rest = match.group(1), (match.group(2) or "").strip()
    if command == "/fail":
        # An input a tool round already followed was answered before: it
        # does not fail the request that reports the results.
        said = rest.partition(" ")[2] if item.handled else _fail(rest, attempt)
        return _Effect(text=_echo(said, item.attachments))
    if command == "/slow":
        seconds, _, said = rest.partition(" ")
        try:
            duration = max(0.0, float(seconds))
        except ValueError:
            return _Effect(text=_echo(text, item.attachments))
        return _Effect(text=_echo(said, item.attachments), seconds=duration)
    if command == "/long" and rest.isdigit():
        return _Effect(text=long_text(int(rest)))
    if command == "/think":
        return _Effect(
            thinking=f"The user wants this repeated back: {rest}. An echo answers that.",
            text=_echo(rest, item.attachments),
        )
    if command == "/tool":
        try:
            return _Effect(calls=parse_tool_calls(rest))
        except ValueError as exc:
            return _Effect(text=f"I could not read that /tool command: {exc}")
    return _Effect(text=_echo(text, item.attachments))


def _history_digests(messages: Sequence[Mapping[str, Any]], positions: set[int]) -> dict[int, str]:
    """position -> digest of every message before it (one pass, however
    many inputs of the batch call tools)."""
    digest = hashlib.sha256()
    found: dict[int, str] = {}
    for position, message in enumerate(messages):
        if position in positions:
            found[position] = digest.hexdigest()[:16]
            if len(found) == len(positions):
                break
        encoded = json.dumps(message, sort_keys=True, ensure_ascii=False, default=str)
        digest.update(encoded.encode() + b"\0")
    return found


def batch_reply(messages: Sequence[Mapping[str, Any]], attempt: int) -> Reply:
    """The scripted answer to a turn request showing `messages`."""
    start = _exchange_start(messages)
    inputs: list[_Input] = []
    calls: dict[str, str] = {}
    results: list[Mapping[str, Any]] = []
    for position in range(start, len(messages)):
        message = messages[position]
        role = message.get("role")
        if role == "user":
            text, attachments = _split_user(message)
            if not attachments and text.startswith(SUMMARY_INTRO):
                continue  # a compaction summary, not an input
            inputs.append(_Input(position, text, attachments, handled=False))
        elif role == "assistant" and _has_tool_calls(message):
            inputs = [_Input(i.position, i.text, i.attachments, True) for i in inputs]
            for block in message.get("content") or ():
                if block.get("type") == "toolCall":
                    calls[block.get("id", "")] = block.get("name", "")
        elif role == "toolResult":
            results.append(message)

    effects = [(item, _effect(item, attempt)) for item in inputs]
    pending = [(item, effect) for item, effect in effects if not item.handled]
    slow = [effect.seconds for _, effect in pending if effect.seconds is not None]
    duration = sum(slow) if slow else None
    new_calls: list[Mapping[str, Any]] = []
    if any(effect.calls for _, effect in pending):
        history = _history_digests(messages, {item.position for item, e in pending if e.calls})
        for item, effect in pending:
            for index, call in enumerate(effect.calls):
                call_id = tool_call_id(item.text, item.position, index, history[item.position])
                new_calls.append(call.with_id(call_id))
        names = ", ".join(str(call["name"]) for call in new_calls)
        return Reply(
            text=f"Calling {names}.",
            tool_calls=tuple(new_calls),
            stop_reason="toolUse",
            seconds=duration,
        )
    lines = [effect.text for _, effect in effects if effect.text]
    lines.extend(_result_lines(results, calls))
    if not inputs and not results:
        lines.append(_echo(""))
    thinking = "\n".join(effect.thinking for _, effect in effects if effect.thinking)
    return Reply(text="\n".join(lines), thinking=thinking, seconds=duration)


def _result_lines(results: Sequence[Mapping[str, Any]], calls: Mapping[str, str]) -> list[str]:
    # Results are paired with the calls read back from the transcript, not
    # recomputed: a compaction may have moved (or summarized) the inputs.
    unanswered = dict(calls)
    lines = []
    for result in results:
        call_id = result.get("toolCallId", "")
        name = unanswered.pop(call_id, None) or result.get("toolName", "tool")
        verb = "failed with" if result.get("isError") else "returned"
        lines.append(f"Tool {name} {verb}: {message_text(result)}")
    lines.extend(f"Tool {name} returned no result." for name in unanswered.values())
    return lines
