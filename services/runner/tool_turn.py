"""The tool side of an attempt's turns: settling the open calls, and a cancel.

Every open call is settled in order: run (at least once: a crash between
the run and the commit of its result runs it again), refused with an error
result (arguments that were not a JSON object, a response cut at the output
limit), or, for a tool that needs a person's approval, left waiting behind
an `approval_requested` fact. A client's cancel closes the open and waiting
calls and consumes the inputs it covers.

Apart from the attempt's state (services/runner/attempt.py), whose
`run_tools` and `settle_cancelled` call these, and from the model turn
(services/runner/model_turn.py), because tools are their own failure mode:
they run outside the model and commit one fact per call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agent_io.tools import ToolCall, ToolOutcome, idempotency_key
from services.common import faults, tracing
from services.ledger.facts import APPROVAL_REQUESTED, ASSISTANT, TOOL_RESULT
from services.runner import metrics as runner_metrics
from services.runner import transcript as T

if TYPE_CHECKING:
    from services.runner.attempt import Attempt


async def run_tools(attempt: Attempt, calls: Sequence[T.OpenCall]) -> None:
    """Settles every open call: runs it (at-least-once) and commits its
    result, refuses it with an error result, or asks for approval."""
    for index, call in enumerate(calls):
        last = index == len(calls) - 1
        refusal = T.refusal(call)
        asks = refusal is None and call.decision is None
        if asks and attempt.tools.requires_approval(call.name):
            await attempt.commit(
                APPROVAL_REQUESTED,
                {
                    "toolCallId": call.tool_call_id,
                    "name": call.name,
                    "arguments": dict(call.arguments),
                },
            )
            attempt.boundary("after_approval_requested")
            continue
        tool_call = ToolCall(
            call.tool_call_id,
            call.name,
            call.arguments,
            idempotency_key(attempt.lease.tenant_id, attempt.session_id, call.tool_call_id),
            session_id=attempt.session_id,
            tenant_id=attempt.lease.tenant_id,
        )
        if refusal is not None:
            outcome = ToolOutcome(refusal, is_error=True)
        else:
            with tracing.span(
                "keel.tool",
                attempt.trace_attributes,
                {"keel.tool.name": call.name, "keel.tool.call_id": call.tool_call_id},
            ):
                called = time.perf_counter()
                outcome = await attempt.tools.run(tool_call)
            runner_metrics.tool_called(
                call.name, (time.perf_counter() - called) * 1000, outcome.is_error
            )
            # Executed, result not yet committed: a crash here is the
            # at-least-once case (the successor runs the tool again).
            faults.hit("mid_tool")
        result: dict[str, Any] = {
            "toolCallId": call.tool_call_id,
            "content": outcome.content,
            "isError": outcome.is_error,
            "idempotencyKey": tool_call.idempotency_key,
        }
        if outcome.structured is not None:
            result["structured"] = dict(outcome.structured)
        if outcome.blobs:
            # Images and resources the tool returned, stored as the tenant's blobs.
            result["blobs"] = list(outcome.blobs)
        await attempt.commit(TOOL_RESULT, result)
        attempt.boundary("after_tool_results" if last else "after_some_tool_results")


async def settle_cancelled(attempt: Attempt, owed: T.Owed) -> None:
    """A client cancelled: close open calls (waiting ones too), consume
    what the cancel covers."""
    for call in (*owed.open_calls, *owed.waiting_calls):
        await attempt.commit(
            TOOL_RESULT,
            {"toolCallId": call.tool_call_id, "content": "cancelled", "isError": True},
        )
    # Calls closed, the cancelled inputs not yet consumed: a successor
    # must close the settlement without closing a call twice.
    faults.hit("mid_cancel")
    with attempt.answering(owed.cancelled_input_seqs):
        await attempt.commit(
            ASSISTANT,
            {
                "generationId": T.cancel_generation_id(
                    owed.latest_cancel_seq, owed.cancelled_input_seqs
                ),
                "content": [],
                "toolCalls": [],
                "inputSeqs": list(owed.cancelled_input_seqs),
                "stopReason": T.CANCELLED_STOP,
            },
        )
