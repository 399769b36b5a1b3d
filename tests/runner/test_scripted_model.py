"""The offline scripted model: every command, determinism, limits, summaries."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from agent_io.providers import (
    Completed,
    ContextOverflow,
    ModelRequest,
    ProviderError,
    ScriptedModel,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    provider_from_loadout,
)
from agent_io.providers.scripted import split_tokens
from compaction.policy import (
    SUMMARY_INTRO,
    CompactionSettings,
    estimate_text_tokens,
    is_context_overflow,
    message_from_dict,
    plan_summary,
    prepare,
    to_entries,
)
from compaction.transcript import request_messages
from services.common.secrets import SecretPolicy
from services.ledger.facts import CommittedFact

SYSTEM = "You are a test agent."
HEADINGS = (
    "## Goal",
    "## Constraints & Preferences",
    "## Progress",
    "### Done",
    "### In Progress",
    "### Blocked",
    "## Key Decisions",
    "## Next Steps",
    "## Critical Context",
)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def turn(*messages: Mapping[str, Any], **overrides: Any) -> ModelRequest:
    return ModelRequest(system=SYSTEM, messages=tuple(messages), **overrides)


async def run(request: ModelRequest, model: ScriptedModel | None = None) -> list[StreamEvent]:
    events = [event async for event in (model or ScriptedModel()).stream(request)]
    assert isinstance(events[-1], Completed)
    assert not any(isinstance(event, Completed) for event in events[:-1])
    return events


async def answer(request: ModelRequest, model: ScriptedModel | None = None) -> Completed:
    completed = (await run(request, model))[-1]
    assert isinstance(completed, Completed)
    return completed


def text_of(completed: Completed) -> str:
    return "".join(block["text"] for block in completed.content if block["type"] == "text")


def assistant_fact(completed: Completed) -> dict[str, Any]:
    calls = [{"type": "toolCall", **call} for call in completed.tool_calls]
    return {"role": "assistant", "content": [*completed.content, *calls]}


def tool_result(call: Mapping[str, Any], text: str, is_error: bool = False) -> dict[str, Any]:
    return {
        "role": "toolResult",
        "toolCallId": call["id"],
        "toolName": call["name"],
        "content": [{"type": "text", "text": text}],
        "isError": is_error,
    }


def estimate(request: ModelRequest) -> int:
    messages = sum(message_from_dict(message).tokens for message in request.messages)
    return estimate_text_tokens(request.system) + messages


@pytest.mark.parametrize("text", ["", "one", "  lead\n\nand trail  ", "naïve 🙂 text\tx"])
def test_tokens_reassemble_exactly(text: str) -> None:
    assert "".join(split_tokens(text)) == text


async def test_plain_text_is_echoed_token_by_token() -> None:
    request = turn(user("/fail"), {"role": "assistant", "content": "x"}, user("hello big world"))
    events = await run(request, ScriptedModel(model="scripted-x"))
    deltas = events[:-1]
    assert len(deltas) == 5 and all(isinstance(event, TextDelta) for event in deltas)
    assert "".join(event.text for event in deltas if isinstance(event, TextDelta)) == (
        "You said: hello big world"
    )
    completed = events[-1]
    assert isinstance(completed, Completed)
    assert completed.content == ({"type": "text", "text": "You said: hello big world"},)
    assert completed.tool_calls == ()
    assert completed.stop_reason == "stop"
    assert completed.model == "scripted-x"
    assert completed.usage.input == estimate(request)
    assert completed.usage.output == estimate_text_tokens("You said: hello big world")


async def test_user_text_blocks_are_read() -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "/think deep"}]}
    events = await run(turn(message))
    assert isinstance(events[0], ThinkingDelta)
    completed = events[-1]
    assert isinstance(completed, Completed)
    thinking, text = completed.content
    assert thinking["type"] == "thinking" and "deep" in thinking["thinking"]
    assert text == {"type": "text", "text": "You said: deep"}
    first_text = next(i for i, event in enumerate(events) if isinstance(event, TextDelta))
    assert all(isinstance(event, ThinkingDelta) for event in events[:first_text])


async def test_token_delay_paces_the_stream() -> None:
    started = time.monotonic()
    await run(turn(user("a b c")), ScriptedModel(token_delay_ms=20))
    assert time.monotonic() - started >= 0.09  # 5 tokens x 20 ms, minus timer slack


async def test_slow_spreads_the_reply_over_the_duration() -> None:
    started = time.monotonic()
    completed = await answer(turn(user("/slow 0.3 take your time")))
    elapsed = time.monotonic() - started
    assert 0.28 <= elapsed < 1.5
    assert text_of(completed) == "You said: take your time"


async def test_slow_stream_can_be_cancelled() -> None:
    received: list[StreamEvent] = []

    async def consume() -> None:
        async for event in ScriptedModel().stream(turn(user("/slow 30 never finishes this"))):
            received.append(event)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(isinstance(event, Completed) for event in received)


async def test_an_instant_long_stream_lets_other_tasks_run() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await run(turn(user("/long 4000")))
    task.cancel()
    assert ticks - before > 10  # a lease renewal would not have starved


async def test_tool_call_then_answer_with_its_result() -> None:
    ask = user('/tool clock {"tz": "UTC"}')
    events = await run(turn(ask))
    completed = events[-1]
    assert isinstance(completed, Completed)
    (call,) = completed.tool_calls
    assert call["name"] == "clock" and call["arguments"] == {"tz": "UTC"}
    assert call["id"].startswith("call_")
    assert completed.stop_reason == "toolUse"
    assert text_of(completed) == "Calling clock."
    tool_deltas = [event for event in events if isinstance(event, ToolCallDelta)]
    assert tool_deltas == [ToolCallDelta(0, call["id"], "clock", json.dumps({"tz": "UTC"}))]

    final = await answer(turn(ask, assistant_fact(completed), tool_result(call, "12:00 UTC")))
    assert final.stop_reason == "stop" and final.tool_calls == ()
    assert text_of(final) == "Tool clock returned: 12:00 UTC"


async def test_several_tool_calls_in_one_message() -> None:
    ask = user('/tool a {"x":1} | b {} | counter {"key":"k"} | clock')
    completed = await answer(turn(ask))
    names = [call["name"] for call in completed.tool_calls]
    assert names == ["a", "b", "counter", "clock"]
    assert [call["arguments"] for call in completed.tool_calls] == [{"x": 1}, {}, {"key": "k"}, {}]
    assert len({call["id"] for call in completed.tool_calls}) == 4

    calls = completed.tool_calls
    results = [
        tool_result(calls[0], "one"),
        tool_result(calls[1], "boom", is_error=True),
        tool_result(calls[2], "3"),
    ]
    final = await answer(turn(ask, assistant_fact(completed), *results))
    assert text_of(final).splitlines() == [
        "Tool a returned: one",
        "Tool b failed with: boom",
        "Tool counter returned: 3",
        "Tool clock returned no result.",
    ]


async def test_tool_call_ids_are_a_function_of_the_request() -> None:
    request = turn(user("earlier"), {"role": "assistant", "content": "ok"}, user("/tool clock"))
    first = await answer(request, ScriptedModel())
    again = await answer(request, ScriptedModel())  # a successor re-running the context
    assert first.tool_calls == again.tool_calls

    moved = await answer(turn(user("/tool clock")))
    reworded = await answer(
        turn(user("earlier"), {"role": "assistant", "content": "ok"}, user("/tool clock {}"))
    )
    assert moved.tool_calls[0]["id"] != first.tool_calls[0]["id"]
    assert reworded.tool_calls[0]["id"] != first.tool_calls[0]["id"]


@pytest.mark.parametrize("spec", ["a {} b {}", "", "{}", "a |"])
async def test_unreadable_tool_command_gets_an_explanation(spec: str) -> None:
    completed = await answer(turn(user(f"/tool {spec}")))
    assert completed.tool_calls == ()
    assert completed.stop_reason == "stop"
    assert text_of(completed).startswith("I could not read that /tool command")


async def test_tool_reaches_prefixed_names() -> None:
    ask = user('/tool files.echo {"text":"hi"} | mcp-x.a/b')
    completed = await answer(turn(ask))
    assert [(call["name"], call["arguments"]) for call in completed.tool_calls] == [
        ("files.echo", {"text": "hi"}),
        ("mcp-x.a/b", {}),
    ]
    results = [tool_result(completed.tool_calls[0], "hi"), tool_result(completed.tool_calls[1], "")]
    final = await answer(turn(ask, assistant_fact(completed), *results))
    assert text_of(final).splitlines()[0] == "Tool files.echo returned: hi"


def presented(facts: Sequence[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], ...]:
    """The messages a request shows for these facts, as the runner builds them."""
    committed = [
        CommittedFact("s", seq, kind, data, 0, 1) for seq, (kind, data) in enumerate(facts, 1)
    ]
    return request_messages(committed)


async def test_malformed_arguments_are_sent_as_written() -> None:
    # A real model's malformed or cut-off arguments, offline: the call keeps
    # the text, so the attempt can refuse to run it and say why.
    events = await run(turn(user("/tool files.echo {bad json")))
    completed = events[-1]
    assert isinstance(completed, Completed)
    (call,) = completed.tool_calls
    assert call == {
        "id": call["id"],
        "name": "files.echo",
        "arguments": {},
        "argumentsText": "{bad json",
    }
    assert completed.stop_reason == "toolUse"
    assert [e for e in events if isinstance(e, ToolCallDelta)] == [
        ToolCallDelta(0, call["id"], "files.echo", "{bad json")
    ]
    again = await answer(turn(user("/tool files.echo {bad json")), ScriptedModel())
    assert again.tool_calls == completed.tool_calls  # the same call id: deterministic

    # Presented back as the transcript shows it (the raw text), the usage
    # the model reported is the policy's count of that very message.
    facts: list[tuple[str, dict[str, Any]]] = [
        ("input", {"text": "/tool files.echo {bad json"}),
        ("epoch_started", {"watermark": 1}),
        ("assistant", {"content": list(completed.content), "toolCalls": [dict(call)]}),
    ]
    messages = presented(facts)
    assert messages[1]["content"][-1]["arguments"] == "{bad json"
    assert completed.usage.output == message_from_dict(messages[1]).tokens

    problem = "not run: the arguments are not a JSON object"
    facts.append(("tool_result", {"toolCallId": call["id"], "content": problem, "isError": True}))
    final = await answer(turn(*presented(facts)))
    assert final.tool_calls == ()
    assert text_of(final) == f"Tool files.echo failed with: {problem}"


@pytest.mark.parametrize(
    ("spec", "calls"),
    [
        ("a {} | b [1]", [("a", {}, None), ("b", {}, "[1]")]),
        ('clock ["a"]', [("clock", {}, '["a"]')]),
        ("clock {nope", [("clock", {}, "{nope")]),
        # Where a malformed object ends cannot be known: it runs to the end.
        ("a {bad | b {}", [("a", {}, "{bad | b {}")]),
        ("a 5  ", [("a", {}, "5")]),
    ],
)
async def test_arguments_that_are_not_an_object_end_the_command(
    spec: str, calls: list[tuple[str, dict[str, Any], str | None]]
) -> None:
    completed = await answer(turn(user(f"/tool {spec}")))
    assert [
        (call["name"], call["arguments"], call.get("argumentsText"))
        for call in completed.tool_calls
    ] == calls


async def test_fail_is_terminal() -> None:
    with pytest.raises(ProviderError) as caught:
        await run(turn(user("/fail")))
    assert not caught.value.retryable
    assert not isinstance(caught.value, ContextOverflow)
    assert str(caught.value) == "scripted failure"


async def test_fail_n_fails_the_first_attempts_then_answers() -> None:
    for attempt in (1, 2):
        with pytest.raises(ProviderError) as caught:
            await run(turn(user("/fail 2 finally"), attempt=attempt))
        assert caught.value.retryable
    completed = await answer(turn(user("/fail 2 finally"), attempt=3))
    assert text_of(completed) == "You said: finally"


@pytest.mark.parametrize("tokens", [1, 7, 500, 3000])
async def test_long_reply_has_the_asked_size(tokens: int) -> None:
    completed = await answer(turn(user(f"/long {tokens}")))
    assert estimate_text_tokens(text_of(completed)) == tokens
    assert completed.usage.output == tokens
    assert completed.stop_reason == "stop"
    assert text_of(completed) == text_of(await answer(turn(user(f"/long {tokens}"))))


async def test_replies_stop_at_the_output_budget() -> None:
    completed = await answer(turn(user("/long 5000"), max_output_tokens=1000))
    assert completed.stop_reason == "length"
    assert estimate_text_tokens(text_of(completed)) == 1000
    capped = await answer(turn(user("/long 5000")), ScriptedModel(max_output_tokens=300))
    assert estimate_text_tokens(text_of(capped)) == 300


async def test_overflow_beyond_the_context_window() -> None:
    request = turn(user("x" * 400))
    needed = estimate(request)
    await answer(request, ScriptedModel(context_window=needed))  # exactly fits
    with pytest.raises(ContextOverflow) as caught:
        await run(request, ScriptedModel(context_window=needed - 1))
    assert is_context_overflow(str(caught.value))
    assert not caught.value.retryable


def summary_request(
    messages: Sequence[Mapping[str, Any]], reserve_tokens: int = 16384
) -> ModelRequest:
    """A summary request exactly as the compaction policy plans it."""
    entries = to_entries({"type": "message", "message": message} for message in messages)
    settings = CompactionSettings(reserve_tokens=reserve_tokens, keep_recent_tokens=5)
    preparation = prepare(entries, settings)
    assert preparation is not None
    planned = plan_summary(preparation, settings).history_request
    assert planned is not None
    return ModelRequest(
        system=planned.system_prompt,
        messages=({"role": "user", "content": planned.prompt},),
        max_output_tokens=planned.max_output_tokens,
        purpose="summary",
    )


CONVERSATION = (
    user("Please build the parser for config files.\nIt must accept TOML."),
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Starting."},
            {"type": "toolCall", "id": "c1", "name": "read_file", "arguments": {"p": "a"}},
        ],
    },
    {"role": "toolResult", "toolCallId": "c1", "content": "file body", "isError": False},
    {"role": "assistant", "content": [{"type": "text", "text": "Read it."}]},
    user("Now add tests."),
    {"role": "assistant", "content": [{"type": "text", "text": "Adding tests now."}]},
)


async def test_summary_is_a_structured_checkpoint() -> None:
    request = summary_request(CONVERSATION)
    completed = await answer(request)
    summary = text_of(completed)
    positions = [summary.index(heading) for heading in HEADINGS]
    assert positions == sorted(positions)
    assert '## Goal\n"Please build the parser for config files."\n' in summary
    assert "read_file" in summary
    assert completed.stop_reason == "stop"
    assert completed.usage.input == estimate(request)
    assert summary == text_of(await answer(request))  # deterministic


@pytest.mark.parametrize("budget", [3, 40, 90, 200])
async def test_summary_never_exceeds_its_budget(budget: int) -> None:
    long_request = user("Refactor everything " * 200)
    request = summary_request((long_request, *CONVERSATION[1:]))
    request = ModelRequest(
        system=request.system,
        messages=request.messages,
        max_output_tokens=budget,
        purpose="summary",
    )
    completed = await answer(request)
    assert estimate_text_tokens(text_of(completed)) <= budget
    assert completed.stop_reason == "stop"


async def test_summary_update_keeps_the_previous_goal() -> None:
    previous = "## Goal\nShip the parser.\n\n## Constraints & Preferences\nNone stated."
    prompt = (
        f"<conversation>\n[User]: more work\n\n[Assistant]: done\n</conversation>\n\n"
        f"<previous-summary>\n{previous}\n</previous-summary>\n\nUpdate it."
    )
    request = ModelRequest(
        system="Summarize.", messages=(user(prompt),), max_output_tokens=2000, purpose="summary"
    )
    summary = text_of(await answer(request))
    assert summary.startswith("## Goal\nShip the parser.\n")
    assert '"more work"' in summary


async def test_failsummary_makes_the_summarizer_fail() -> None:
    request = summary_request((user("/failsummary"), *CONVERSATION))
    with pytest.raises(ProviderError) as caught:
        await run(request)
    assert not isinstance(caught.value, ContextOverflow)
    # In an ordinary turn it is just text.
    assert text_of(await answer(turn(user("/failsummary")))) == "You said: /failsummary"


async def test_slowsummary_makes_the_summary_stream_take_that_long() -> None:
    request = summary_request((user("/slowsummary 0.3 then summarize"), *CONVERSATION))
    started = time.monotonic()
    completed = await answer(request)
    assert time.monotonic() - started >= 0.3  # paced over at least the asked time
    assert "## Goal" in text_of(completed)
    # In an ordinary turn it is just text.
    assert text_of(await answer(turn(user("/slowsummary 5")))) == "You said: /slowsummary 5"


# -- a batch: several inputs answered by one request --

EARLIER = (user("earlier"), {"role": "assistant", "content": [{"type": "text", "text": "ok"}]})


async def test_every_input_of_a_batch_is_acted_on() -> None:
    batch = (
        user("hello there"),
        user('/tool counter {"key":"a"}'),
        user('/tool counter {"key":"b"}'),
    )
    calling = await answer(turn(*EARLIER, *batch))
    assert calling.stop_reason == "toolUse"
    assert [(c["name"], c["arguments"]) for c in calling.tool_calls] == [
        ("counter", {"key": "a"}),
        ("counter", {"key": "b"}),
    ]
    assert len({c["id"] for c in calling.tool_calls}) == 2
    assert text_of(calling) == "Calling counter, counter."
    # A successor re-running the same request proposes the same calls.
    assert (await answer(turn(*EARLIER, *batch))).tool_calls == calling.tool_calls

    first, second = calling.tool_calls
    results = (tool_result(first, "a is 1"), tool_result(second, "b is 1"))
    final = await answer(turn(*EARLIER, *batch, assistant_fact(calling), *results))
    assert final.tool_calls == () and final.stop_reason == "stop"
    assert text_of(final).splitlines() == [
        "You said: hello there",
        "Tool counter returned: a is 1",
        "Tool counter returned: b is 1",
    ]


async def test_a_batch_adds_up_its_commands() -> None:
    started = time.monotonic()
    completed = await answer(
        turn(*EARLIER, user("/slow 0.2 one"), user("/think two"), user("/slow 0.2 three"))
    )
    assert time.monotonic() - started >= 0.4  # both durations, one after the other
    thinking, text = completed.content
    assert thinking["type"] == "thinking" and "two" in thinking["thinking"]
    assert text["text"].splitlines() == ["You said: one", "You said: two", "You said: three"]

    with pytest.raises(ProviderError, match="scripted failure"):
        await run(turn(*EARLIER, user("fine"), user("/fail"), user("also fine")))


async def test_inputs_shown_after_a_tool_round_get_their_own_calls() -> None:
    # A successor with a higher watermark: new inputs follow the results of
    # the calls its predecessor made.
    ask = user("/tool clock")
    calling = await answer(turn(*EARLIER, ask))
    (clock,) = calling.tool_calls
    round_one = (ask, assistant_fact(calling), tool_result(clock, "12:00"))
    late = (user("and this"), user('/tool counter {"key":"late"}'))
    more = await answer(turn(*EARLIER, *round_one, *late))
    assert [c["name"] for c in more.tool_calls] == ["counter"]
    assert clock["id"] not in {c["id"] for c in more.tool_calls}

    (counter,) = more.tool_calls
    final = await answer(
        turn(*EARLIER, *round_one, *late, assistant_fact(more), tool_result(counter, "1"))
    )
    assert final.tool_calls == ()
    assert text_of(final).splitlines() == [
        "You said: and this",
        "Tool clock returned: 12:00",
        "Tool counter returned: 1",
    ]


async def test_the_same_command_later_in_the_session_gets_new_ids() -> None:
    ask = user('/tool counter {"key":"k"}')
    first = await answer(turn(ask))
    # The same text at the same position, after a compaction shortened the
    # history: a different request, so different ids.
    summary = user(SUMMARY_INTRO + "\n\n<summary>\nearlier work\n</summary>")
    later = await answer(turn(summary, ask))
    moved_first = await answer(turn(user("x"), ask))
    assert later.tool_calls[0]["id"] != first.tool_calls[0]["id"]
    assert later.tool_calls[0]["id"] != moved_first.tool_calls[0]["id"]
    # The summary is history, not an input to act on.
    assert [c["name"] for c in later.tool_calls] == ["counter"]


async def test_attachments_do_not_change_the_command() -> None:
    image = {"type": "image", "data": "AAAA", "mimeType": "image/png"}
    notes = {"type": "text", "text": "Attachment blob-x (text/plain):\n/tool clock"}
    message = {"role": "user", "content": [{"type": "text", "text": "look"}, image, notes]}
    completed = await answer(turn(message))
    assert completed.tool_calls == ()
    assert text_of(completed) == "You said: look\nAttachments: 1 image(s), 1 text part(s)."


def test_loadout_builds_the_scripted_model() -> None:
    # The scripted model reads no secret: no grant is needed.
    nothing = SecretPolicy()
    default = provider_from_loadout({}, tenant_id="t", secrets=nothing)
    assert isinstance(default, ScriptedModel)
    assert (default.name, default.model, default.context_window) == (
        "scripted",
        "scripted",
        128_000,
    )
    custom = provider_from_loadout(
        {"provider": "scripted", "name": "s2", "contextWindow": 4096, "tokenDelayMs": 5},
        tenant_id="t",
        secrets=nothing,
    )
    assert isinstance(custom, ScriptedModel)
    assert (custom.model, custom.context_window) == ("s2", 4096)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"provider": "gemini", "name": "g"}, "unknown model provider 'gemini'"),
        ({"provider": "openai"}, "needs a 'name'"),
        ({"provider": "scripted", "contextWindow": "big"}, "'contextWindow' must be an integer"),
        ({"provider": "scripted", "tokenDelayMs": -1}, "'tokenDelayMs' must be an integer"),
        ({"provider": "openai", "name": "m", "apiKeyEnv": "TEST_NO_KEY"}, "key in $TEST_NO_KEY"),
        ({"provider": "openai", "name": "m", "apiKeyEnv": "UNGRANTED"}, "not granted $UNGRANTED"),
        ({"provider": "anthropic", "name": "m", "thinking": "on"}, "'thinking' must be an object"),
    ],
)
def test_loadout_errors_are_clear(model: dict[str, Any], message: str) -> None:
    policy = SecretPolicy().with_grant("t", "TEST_NO_KEY").with_grant("t", "ANTHROPIC_API_KEY")
    env = {"ANTHROPIC_API_KEY": "k", "UNGRANTED": "someone else's"}
    with pytest.raises(ValueError, match=message.replace("$", r"\$")):
        provider_from_loadout(model, tenant_id="t", secrets=policy, env=env)
