"""One model turn of an attempt: build the request, stream the answer, commit it.

The context is built once per turn (the compaction check and the request
share it), compaction runs first when the context would not fit, and a
context that still overflows the model's window after compaction fails the
attempt for good. Partials (text, thinking, tool-call fragments) are
published to the hub as they stream; the answer is committed with a
generation id derived from its context, so a repeated answer deduplicates.

Apart from the attempt's state and its ledger access (services/runner/
attempt.py), whose `answer` and `stream` call these, because this is what
talking to the model is; the tool side of a turn is services/runner/tool_turn.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, cast

from agent_io.providers import (
    Completed,
    ContextOverflow,
    ModelRequest,
    ProviderError,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
)
from services.common import faults, tracing
from services.ledger.facts import ASSISTANT
from services.runner import metrics as runner_metrics
from services.runner import transcript as T
from services.runner.hub import Partial

if TYPE_CHECKING:
    from services.runner.attempt import Attempt


async def answer(attempt: Attempt, owed: T.Owed) -> None:
    """One model turn on what is owed: the context built (compacted first
    when it must be), the model's answer streamed and committed."""
    with tracing.span("keel.context_build", attempt.trace_attributes):
        await attempt.fetch_blobs()
        # Built once here; the compaction check and the request reuse it.
        attempt.context()
    compacted = await attempt.services.compaction.before_request(
        attempt, attempt.facts, overflowed=False
    )
    if compacted:
        attempt.boundary("after_compaction")
        return
    messages, messages_tokens = T.presented_request(attempt.context())
    generation = T.generation_id(owed.context_head_seq)
    request = ModelRequest(
        system=attempt.loadout.system_prompt,
        messages=messages,
        tools=attempt.tools.specs,
        max_output_tokens=attempt.loadout.max_output_tokens,
        attempt=attempt.lease.failures + 1,
        messages_tokens=messages_tokens,
        generation_id=generation,
    )
    try:
        with tracing.span(
            "keel.provider", attempt.trace_attributes, {"gen_ai.request.model": attempt.model_name}
        ) as provider_span:
            with attempt.provider_call.timing(attempt.provider.name) as call:
                completed = await attempt.stream(request, generation)
                call.completed(completed.usage)
            tracing.set_attributes(
                provider_span,
                {
                    "gen_ai.response.model": completed.model,
                    "gen_ai.usage.input_tokens": completed.usage.input,
                    "gen_ai.usage.output_tokens": completed.usage.output,
                },
            )
    except ContextOverflow:
        attempt.overflows_in_a_row += 1
        if attempt.overflows_in_a_row > 1:
            raise ProviderError(
                "the context still overflows the model's window after compaction",
                retryable=False,
            ) from None
        await attempt.services.compaction.before_request(attempt, attempt.facts, overflowed=True)
        return
    attempt.overflows_in_a_row = 0
    final = not completed.tool_calls
    data: dict[str, Any] = {
        "generationId": generation,
        "content": list(completed.content),
        "toolCalls": [dict(c) for c in completed.tool_calls],
        "usage": completed.usage.to_dict(),
        "model": completed.model,
        "stopReason": completed.stop_reason,
    }
    if final:
        data["inputSeqs"] = list(owed.input_seqs)
    if attempt.resumed:
        # GetContext and compaction read a request's watermark from its
        # epoch's epoch_started, which an earlier turn wrote.
        data["watermark"] = attempt.watermark
    # Right before the write, with no await in between: a runner stopped
    # here sends this append first when it is resumed.
    faults.hit("before_final_answer" if final else "before_assistant_commit")
    with attempt.answering(owed.input_seqs if final else ()):
        await attempt.commit(ASSISTANT, data, last=final)
    if final:
        runner_metrics.turn_answered()
    if final and faults.injected("duplicate_reply"):
        await attempt.commit(ASSISTANT, {**data, "generationId": f"{generation}-again"})
    # The final answer's boundary is in the runtime, between it and Finish.
    attempt.boundary("after_final_answer" if final else "after_assistant_commit")


async def stream(attempt: Attempt, request: ModelRequest, generation: str) -> Completed:
    """Streams the model's answer, publishing its partials as they come."""
    hub = attempt.services.hub
    session_id, epoch, attempt_id = attempt.session_id, attempt.epoch, attempt.attempt_id
    completed: Completed | None = None
    first = True
    # Some providers (OpenAI streaming) name a tool call only in its first
    # fragment; every partial names its call, so that a client can tell
    # parallel calls apart: index -> (call id, tool name).
    calls: dict[int, tuple[str, str]] = {}
    # Closed even when the attempt is abandoned mid-stream (cancel, lost
    # lease, handoff), so the provider's HTTP response is released at once.
    events = attempt.provider.stream(request)
    async with contextlib.aclosing(cast(AsyncGenerator[StreamEvent, None], events)) as stream:
        async for event in stream:
            if isinstance(event, TextDelta):
                hub.publish(session_id, Partial(generation, "text", event.text, epoch, attempt_id))
            elif isinstance(event, ThinkingDelta):
                hub.publish(
                    session_id, Partial(generation, "thinking", event.text, epoch, attempt_id)
                )
            elif isinstance(event, ToolCallDelta):
                known_id, known_name = calls.get(event.index, ("", ""))
                call_id, name = event.id or known_id, event.name or known_name
                calls[event.index] = (call_id, name)
                partial = Partial(
                    generation,
                    "tool_call",
                    event.arguments_fragment,
                    epoch,
                    attempt_id,
                    call_id,
                    name,
                )
                hub.publish(session_id, partial)
            elif isinstance(event, Completed):
                completed = event
            if first:
                first = False
                attempt.provider_call.first_event()
                faults.hit("mid_stream")
    if completed is None:
        raise ProviderError("the model stream ended without an answer", retryable=True)
    return completed
