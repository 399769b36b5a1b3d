"""Streamed replies in the providers' wire formats, for the local WireServer.

OpenAI chat-completions chunks (`data:` frames ending with DONE) and
Anthropic messages events (`event:` + `data:` frames), built the way the
official APIs send them.
"""

from __future__ import annotations

from typing import Any

from tests.support.wire_servers import data_frame, event_frame

# ------------------------------------------------------------ OpenAI


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-test-2024",
        "choices": [choice],
    }
    return data_frame(body)


def usage_chunk(prompt: int, completion: int, cached: int = 0) -> str:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-test-2024",
        "choices": [],
        "usage": usage,
    }
    return data_frame(body)


def tool_delta(index: int, arguments: str, call_id: str = "", name: str = "") -> dict[str, Any]:
    part: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        part.update(id=call_id, type="function")
        part["function"]["name"] = name
    return {"tool_calls": [part]}


DONE = data_frame("[DONE]")


# ------------------------------------------------------------ Anthropic


def message_start(input_tokens: int = 25, cache_read: int = 0, cache_write: int = 0) -> str:
    usage = {
        "input_tokens": input_tokens,
        "output_tokens": 1,
        "cache_read_input_tokens": cache_read,
        "cache_creation_input_tokens": cache_write,
    }
    message: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-test-20250101",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return event_frame("message_start", {"type": "message_start", "message": message})


def block_start(index: int, block: dict[str, Any]) -> str:
    payload = {"type": "content_block_start", "index": index, "content_block": block}
    return event_frame("content_block_start", payload)


def block_delta(index: int, delta: dict[str, Any]) -> str:
    payload = {"type": "content_block_delta", "index": index, "delta": delta}
    return event_frame("content_block_delta", payload)


def block_stop(index: int) -> str:
    return event_frame("content_block_stop", {"type": "content_block_stop", "index": index})


def message_end(stop_reason: str, output_tokens: int) -> list[str]:
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": output_tokens},
    }
    return [
        event_frame("message_delta", delta),
        event_frame("message_stop", {"type": "message_stop"}),
    ]


def text_answer(*pieces: str, stop_reason: str = "end_turn") -> list[str]:
    deltas = [block_delta(0, {"type": "text_delta", "text": piece}) for piece in pieces]
    return [
        message_start(),
        block_start(0, {"type": "text", "text": ""}),
        *deltas,
        block_stop(0),
        *message_end(stop_reason, 5),
    ]


def tool_use_answer(
    calls: list[tuple[str, str, list[str]]], stop_reason: str = "tool_use"
) -> list[str]:
    """A message of tool_use blocks: (id, wire name, input JSON pieces) each."""
    frames = [message_start()]
    for index, (call_id, name, pieces) in enumerate(calls):
        start = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        frames.append(block_start(index, start))
        for piece in pieces:
            frames.append(block_delta(index, {"type": "input_json_delta", "partial_json": piece}))
        frames.append(block_stop(index))
    return [*frames, *message_end(stop_reason, 9)]
