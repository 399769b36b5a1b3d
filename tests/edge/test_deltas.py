"""Every delta of an attempt reaches a connected SSE client, tagged.

A model that answers at once (the scripted model with no token delay, or a
local OpenAI-compatible server with no frame delay) is over before the edge
has attached to the attempt: the runner replays the attempt's partials and
the edge holds the attempt's facts until that replay is through. Each delta
names its generation, epoch and attempt, and a tool-call fragment its call,
so a client tells parallel calls and retried attempts apart (SPEC §7, I2).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.cli.chat_view import SseEvent
from services.common.config import Settings
from services.runner.server import RunnerServer
from tests.support.edge_stack import Stack
from tests.support.ports import free_port
from tests.support.sse import SseReader, parse
from tests.support.wire_servers import WireServer, data_frame, sse_reply

MODEL = "gpt-test"


def is_final_answer(input_seq: int) -> Any:
    def matches(event: SseEvent) -> bool:
        return event.event == "assistant" and input_seq in (
            parse(event)["data"].get("inputSeqs") or []
        )

    return matches


async def turn(
    stack: Stack, sse: SseReader, session: str, text: str, events: list[SseEvent]
) -> None:
    """Posts an input and reads the stream up to its final answer."""
    posted = await stack.post_input(session, text, f"req-{len(events)}")
    assert posted.status_code == 202, posted.text
    await sse.until(is_final_answer(posted.json()["seq"]), into=events)


def deltas(events: list[SseEvent]) -> list[tuple[int, dict[str, Any]]]:
    """(position in the stream, payload) of every delta."""
    return [(i, parse(e)) for i, e in enumerate(events) if e.event == "delta"]


def attempt_of(events: list[SseEvent], position: int) -> tuple[int, str]:
    """(epoch, attemptId) of the last epoch_started before `position`."""
    started = [parse(e)["data"] for e in events[:position] if e.event == "epoch_started"]
    assert started, "an answer before any epoch_started"
    return started[-1]["epoch"], started[-1]["attemptId"]


def check_answer_previewed(events: list[SseEvent], position: int) -> dict[str, Any]:
    """The assistant fact at `position` was streamed in full before it came:
    its text, thinking and every tool call's arguments, by the attempt that
    committed it. Returns the deltas' texts by channel."""
    answer = parse(events[position])["data"]
    generation = answer["generationId"]
    epoch, attempt_id = attempt_of(events, position)
    # A retried attempt reuses the generation id: its preview is the one
    # tagged with the committing attempt.
    mine = [
        (i, d)
        for i, d in deltas(events)
        if (d["generationId"], d["epoch"], d["attemptId"]) == (generation, epoch, attempt_id)
    ]
    assert mine, f"no delta of generation {generation} by its attempt"
    assert all(i < position for i, _ in mine), "a delta came after the answer it previews"

    by_channel: dict[str, str] = defaultdict(str)
    calls: dict[str, list[str]] = defaultdict(list)
    names: dict[str, str] = {}
    for _, delta in mine:
        by_channel[delta["channel"]] += delta["text"]
        if delta["channel"] == "tool_call":
            calls[delta["toolCallId"]].append(delta["text"])
            assert names.setdefault(delta["toolCallId"], delta["toolName"]) == delta["toolName"]
        else:
            assert "toolCallId" not in delta and "toolName" not in delta
    content = answer["content"]
    texts = "".join(part["text"] for part in content if part["type"] == "text")
    thoughts = "".join(part["thinking"] for part in content if part["type"] == "thinking")
    assert by_channel["text"] == texts
    assert by_channel["thinking"] == thoughts
    assert {call_id: json.loads("".join(parts)) for call_id, parts in calls.items()} == {
        call["id"]: call["arguments"] for call in answer["toolCalls"]
    }
    assert names == {call["id"]: call["name"] for call in answer["toolCalls"]}
    return dict(by_channel)


def answers(events: list[SseEvent]) -> list[int]:
    return [i for i, e in enumerate(events) if e.event == "assistant"]


async def test_an_instant_model_streams_every_delta_to_a_client_connected_before(
    stack: Stack, runner: RunnerServer
) -> None:
    session = await stack.new_session()
    inputs = ["/think deltas first", "/tool clock {}", "hello there", "/think again", "bye"]
    events: list[SseEvent] = []
    async with SseReader(stack.http, session) as sse:
        for text in inputs:
            await turn(stack, sse, session, text, events)

    # Each delta is tagged with the attempt that was running when it came.
    for position, delta in deltas(events):
        assert (delta["epoch"], delta["attemptId"]) == attempt_of(events, position), delta
    positions = answers(events)
    # The tool call's turn answers twice: the call, then the report.
    assert len(positions) == len(inputs) + 1
    channels = [check_answer_previewed(events, position) for position in positions]
    assert all(c.get("text") for i, c in enumerate(channels) if i != 1)
    assert channels[0]["thinking"] and channels[4]["thinking"]
    assert channels[1]["tool_call"] == "{}"
    tool_fragments = [d for _, d in deltas(events) if d["channel"] == "tool_call"]
    call = parse(events[positions[1]])["data"]["toolCalls"][0]
    assert {(d["toolCallId"], d["toolName"]) for d in tool_fragments} == {(call["id"], "clock")}


# ------------------------------------------------ an OpenAI-compatible server


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> str:
    return data_frame(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
        }
    )


def tool_fragment(index: int, arguments: str, call_id: str = "", name: str = "") -> str:
    """OpenAI names a call (id, name) in its first fragment only."""
    part: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        part.update(id=call_id, type="function")
        part["function"]["name"] = name
    return chunk({"tool_calls": [part]})


def text_reply(*pieces: str, finished: bool = True) -> list[str]:
    frames = [chunk({"role": "assistant", "content": ""})]
    frames += [chunk({"content": piece}) for piece in pieces]
    if finished:
        frames += [chunk(finish="stop"), data_frame("[DONE]")]
    return frames


@pytest.fixture
def wire_port() -> int:
    return free_port()


@pytest.fixture
def pg_settings(pg_settings: Settings, wire_port: int) -> Settings:
    """The stack's settings, with the operator allowing the wire server."""
    allowed = pg_settings.secrets.with_origin(f"http://127.0.0.1:{wire_port}")
    return pg_settings.with_overrides(secrets=allowed)


@pytest.fixture
async def wire(stack: Stack, wire_port: int) -> AsyncIterator[WireServer]:
    """A local OpenAI-compatible server with no delay, serving tenant "default"."""
    async with WireServer("/v1/chat/completions", port=wire_port) as server:
        await stack.cluster.kernel.put_loadout(
            "default",
            {
                "model": {"provider": "openai", "name": MODEL, "baseUrl": f"{server.url}/v1"},
                "tools": ["clock", "sleep"],
            },
        )
        yield server


async def test_parallel_tool_calls_stream_apart_by_call(
    stack: Stack, wire: WireServer, runner: RunnerServer
) -> None:
    wire.queue(
        sse_reply(
            [
                chunk({"role": "assistant", "content": None}),
                tool_fragment(0, "", "call_clock", "clock"),
                tool_fragment(0, '{"t'),
                tool_fragment(1, '{"sec', "call_sleep", "sleep"),
                tool_fragment(0, 'z": "U'),
                tool_fragment(1, 'onds"'),
                tool_fragment(0, 'TC"}'),
                tool_fragment(1, ": 0}"),
                chunk(finish="tool_calls"),
                data_frame("[DONE]"),
            ]
        ),
        sse_reply(text_reply("Both ", "calls ", "are ", "done.")),
    )
    session = await stack.new_session()
    events: list[SseEvent] = []
    async with SseReader(stack.http, session) as sse:
        await turn(stack, sse, session, "two tools at once", events)

    calls_at, report_at = answers(events)
    assert check_answer_previewed(events, report_at)["text"] == "Both calls are done."
    check_answer_previewed(events, calls_at)
    # The two calls' fragments, told apart by call id and tool name alone.
    fragments: dict[tuple[str, str], str] = defaultdict(str)
    for _, delta in deltas(events):
        if delta["channel"] == "tool_call":
            fragments[(delta["toolCallId"], delta["toolName"])] += delta["text"]
    assert dict(fragments) == {
        ("call_clock", "clock"): '{"tz": "UTC"}',
        ("call_sleep", "sleep"): '{"seconds": 0}',
    }


async def test_a_retried_attempt_streams_apart_from_the_failed_one(
    stack: Stack, wire: WireServer, runner: RunnerServer
) -> None:
    # The first attempt streams part of an answer and is cut off (retryable);
    # the second answers in full with the same generation id.
    wire.queue(
        sse_reply(text_reply("Hello, ", finished=False)),
        sse_reply(text_reply("Hello, ", "world!")),
    )
    session = await stack.new_session()
    events: list[SseEvent] = []
    async with SseReader(stack.http, session) as sse:
        await turn(stack, sse, session, "greet me", events)

    (answer_at,) = answers(events)
    assert check_answer_previewed(events, answer_at)["text"] == "Hello, world!"
    generation = parse(events[answer_at])["data"]["generationId"]
    previews: dict[tuple[int, str], str] = defaultdict(str)
    for _, delta in deltas(events):
        assert delta["generationId"] == generation
        previews[(delta["epoch"], delta["attemptId"])] += delta["text"]
    started = [
        (parse(e)["data"]["epoch"], parse(e)["data"]["attemptId"])
        for e in events
        if e.event == "epoch_started"
    ]
    assert len(started) == 2 and started[0] != started[1]
    assert started[0][0] != started[1][0] and started[0][1] != started[1][1]
    # One preview per attempt: the failed one's can be dropped as a whole.
    assert previews == {started[0]: "Hello, ", started[1]: "Hello, world!"}
    failed = next(i for i, e in enumerate(events) if e.event == "attempt_failed")
    first_preview_at = [i for i, d in deltas(events) if (d["epoch"], d["attemptId"]) == started[0]]
    assert max(first_preview_at) < failed
