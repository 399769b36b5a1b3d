"""Turns a prepared compaction into its summary text, through a model.

The policy decides everything about the prompts (`plan_summary`): what is
serialized, whether the previous summary is updated rather than rewritten,
the output budgets, and the focus a manual compaction asks for. This module
only runs the calls it planned and joins the answers (`assemble_summary`).

A split turn needs two calls (the history, and the turn's beginning); they
are independent, so they run concurrently, and a failure of either cancels
the other: a half summary is never committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass

from agent_io.providers import (
    Completed,
    ContextOverflow,
    ModelRequest,
    Provider,
    ProviderError,
)
from compaction.errors import SummaryFailed
from compaction.policy import (
    CompactionSettings,
    Preparation,
    SummaryRequest,
    assemble_summary,
    plan_summary,
)
from services.common import faults

log = logging.getLogger(__name__)

# Manual instructions longer than this are cut: they are a focus hint, and an
# unbounded one could push the summary request out of the model's window.
MAX_FOCUS_CHARS = 2000


@dataclass(frozen=True, slots=True)
class Summary:
    """The assembled summary and how many model calls produced it."""

    text: str
    model_calls: int


def _request(planned: SummaryRequest, max_output_tokens: int | None) -> ModelRequest:
    budget = planned.max_output_tokens
    if max_output_tokens is not None:
        # The tenant's model may accept less than the policy's budget.
        budget = min(budget, max_output_tokens)
    return ModelRequest(
        system=planned.system_prompt,
        messages=({"role": "user", "content": planned.prompt},),
        max_output_tokens=budget,
        purpose="summary",
    )


def _answer_text(completed: Completed) -> str:
    texts = [
        str(block.get("text", "")) for block in completed.content if block.get("type") == "text"
    ]
    return "".join(texts).strip()


async def _complete(provider: Provider, request: ModelRequest, what: str) -> str:
    completed: Completed | None = None
    started = False
    try:
        async for event in provider.stream(request):
            if not started:
                started = True
                # The model is producing the summary and nothing is committed:
                # crash tests kill the process here to prove a half-written
                # compaction leaves no trace.
                faults.hit("mid_summary")
            if isinstance(event, Completed):
                completed = event
    except ContextOverflow as error:
        raise SummaryFailed(
            f"the {what} request does not fit the model's context window: {error}",
            retryable="false",
        ) from None
    except ProviderError as error:
        raise SummaryFailed(
            f"the model failed to write the {what}: {error}",
            retryable=str(error.retryable).lower(),
        ) from None
    if completed is None:
        raise SummaryFailed(f"the model stream ended without the {what}", retryable="true")
    text = _answer_text(completed)
    if not text:
        raise SummaryFailed(f"the model returned an empty {what}", retryable="true")
    return text


async def _all(calls: list[Awaitable[str]]) -> list[str]:
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def summarize(
    provider: Provider,
    preparation: Preparation,
    settings: CompactionSettings,
    *,
    focus: str | None = None,
    max_output_tokens: int | None = None,
) -> Summary:
    """The summary for `preparation`, written by `provider`.

    `focus` is a manual compaction's instructions (appended to the prompts);
    `max_output_tokens` caps the policy's budgets at what the model accepts.
    Raises SummaryFailed when a call fails or answers with nothing.
    """
    focus = (focus or "").strip()[:MAX_FOCUS_CHARS] or None
    plan = plan_summary(preparation, settings, focus)
    calls: list[Awaitable[str]] = []
    if plan.history_request is not None:
        request = _request(plan.history_request, max_output_tokens)
        calls.append(_complete(provider, request, "summary"))
    if plan.turn_prefix_request is not None:
        request = _request(plan.turn_prefix_request, max_output_tokens)
        calls.append(_complete(provider, request, "split-turn summary"))
    answers = await _all(calls)
    history = answers.pop(0) if plan.history_request is not None else None
    prefix = answers.pop(0) if plan.turn_prefix_request is not None else None
    text = assemble_summary(plan, history, prefix)
    log.debug(
        "summarized %d messages (+%d of a split turn) in %d call(s)",
        len(preparation.messages_to_summarize),
        len(preparation.turn_prefix_messages),
        len(calls),
    )
    return Summary(text=text, model_calls=len(calls))
