"""One attempt: a claim's work on one session, from watermark to Finish.

The attempt's first write is `epoch_started{epoch, watermark}`: the fence
rises and the inputs it will answer are fixed. It then rebuilds the
transcript from the ledger and does only what the ledger says is missing:
tool calls without results first (a dead predecessor's half answer), then
owed inputs. Every answer carries a generation id derived from the context
it was built from, so a repeated answer deduplicates in the ledger.

A call is run only as the model made it, and only when it may run: a call
whose arguments were not a JSON object, or made by a response cut at the
output limit, gets an error result instead; a call of a tool that needs a
person's approval commits `approval_requested` and waits. Waiting is not
work (services/runner/transcript.py): once every open call waits, the
attempt ends like any other and the session holds no lease and no slot until
a decision is committed and wakes it.

Commit boundaries (where a handoff may stop the attempt, and where crash tests
kill it) are the named fault points.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from agent_io.loadout import Loadout
from agent_io.providers import (
    Completed,
    ContextOverflow,
    ModelRequest,
    Provider,
    ProviderError,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
)
from agent_io.tools import ToolCall, ToolOutcome, ToolRegistry, idempotency_key
from compaction.policy import ContextEntry, MessageEntry
from kernel import EpochSuperseded, KernelClient, Lease, LeaseLost
from services.blob_parts import BlobContent
from services.common import faults, tracing
from services.common.config import DEFAULT_MAX_FACT_BYTES
from services.common.errors import ServiceUnavailable
from services.common.outage_log import OutageLog
from services.ledger import LedgerClient, StaleEpoch
from services.ledger.facts import (
    APPROVAL_REQUESTED,
    ASSISTANT,
    EPOCH_STARTED,
    INPUT,
    TOOL_RESULT,
    CommittedFact,
    FactKind,
)
from services.runner import metrics as runner_metrics
from services.runner import transcript as T
from services.runner.events import SessionState
from services.runner.fact_fit import fit_fact
from services.runner.hub import Partial, PartialHub, StatusChange

log = logging.getLogger("keel.runner.attempt")


class Fenced(Exception):
    """The ledger or kernel says another attempt owns the session now."""


class HandoffStop(Exception):
    """A handoff drain asked this attempt to stop at a commit boundary."""


class CompactionHook(Protocol):
    """Plugs compaction into the turn loop (the compaction service implements it)."""

    async def before_request(
        self, attempt: Attempt, facts: Sequence[CommittedFact], *, overflowed: bool
    ) -> bool:
        """Compacts if needed; True when a compaction fact was committed."""
        ...


class NoCompaction:
    async def before_request(
        self, attempt: Attempt, facts: Sequence[CommittedFact], *, overflowed: bool
    ) -> bool:
        return False


@dataclass(frozen=True)
class AttemptServices:
    runtime_id: str
    ledger: LedgerClient
    kernel: KernelClient
    hub: PartialHub
    compaction: CompactionHook
    # True while a handoff drain wants attempts to stop at a commit boundary.
    handoff_requested: Callable[[], bool]
    lease_ms: int
    # What the model is shown of the blobs inputs reference (None: only the
    # inputs' text).
    blobs: BlobContent | None = None
    # The ledger's fact limit: what the runner writes is cut to it first.
    max_fact_bytes: int = DEFAULT_MAX_FACT_BYTES


class Attempt:
    def __init__(
        self,
        services: AttemptServices,
        lease: Lease,
        loadout: Loadout,
        provider: Provider,
        tools: ToolRegistry,
    ) -> None:
        self.services = services
        self.lease = lease
        self.loadout = loadout
        self.provider = provider
        self.tools = tools
        self.session_id = lease.session_id
        self.epoch = lease.epoch
        self.attempt_id = lease.attempt_id or uuid.uuid4().hex
        # The lease is in hand: a takeover's first commit is timed from here.
        self.began = time.perf_counter()
        self.provider_call = runner_metrics.ProviderCall()
        self.watermark = 0
        self.facts: list[CommittedFact] = []
        # seq -> parsed context message, kept across turns (and attempts).
        self.parsed: dict[int, MessageEntry] = {}
        self._context: tuple[int, int, tuple[ContextEntry, ...]] | None = None
        self.overflows_in_a_row = 0
        # Woken in a sticky window: the epoch's `epoch_started` is an
        # earlier turn's (see start()).
        self.resumed = False
        # What every span of this attempt carries.
        self.trace_attributes = {
            tracing.SESSION_ID: self.session_id,
            tracing.TENANT_ID: lease.tenant_id,
            tracing.EPOCH: self.epoch,
            tracing.ATTEMPT_ID: self.attempt_id,
        }

    def turn_traceparents(self) -> list[Any]:
        """The trace contexts of the inputs this attempt will answer, oldest
        first (cancelled ones when only a cancel is owed)."""
        owed = T.owed(self.facts, T.read_through(self.facts))
        return self._traceparents(owed.input_seqs or owed.cancelled_input_seqs)

    def _traceparents(self, input_seqs: Sequence[int]) -> list[Any]:
        seqs = set(input_seqs)
        return [
            f.data.get(tracing.TRACEPARENT) for f in self.facts if f.kind == INPUT and f.seq in seqs
        ]

    def answering(self, input_seqs: Sequence[int]) -> contextlib.AbstractContextManager[Any]:
        """The span of the commit that answers `input_seqs`, linked to each
        one's trace (tracing.answer_span); none for a commit answering none."""
        if not input_seqs or not tracing.enabled():
            return contextlib.nullcontext()
        extra = {"keel.input_seqs": list(input_seqs)}
        return tracing.answer_span(self.trace_attributes, extra, self._traceparents(input_seqs))

    @property
    def model_name(self) -> str:
        return str(self.loadout.model.get("name") or self.loadout.model.get("model") or "")

    # -- ledger access --

    async def refresh(self) -> list[CommittedFact]:
        after = self.facts[-1].seq if self.facts else 0
        self.facts.extend(await self.services.ledger.read_all(self.session_id, after))
        if self.facts:  # the edge lets facts out after the partials before them
            self.services.hub.committed(self.session_id, self.epoch, self.facts[-1].seq)
        return self.facts

    def context(self) -> tuple[ContextEntry, ...]:
        """The context a request now presents, as the compaction policy's values.

        Computed once per state of the facts: the compaction check and the
        request of one turn share it.
        """
        key = (len(self.facts), self.watermark)
        if self._context is None or self._context[:2] != key:
            blobs = self.services.blobs
            entries = T.windowed_context(
                self.facts,
                self.watermark,
                self.parsed,
                blob_parts=None if blobs is None else blobs.resolver(self.lease.tenant_id),
            )
            self._context = (*key, entries)
        return self._context[2]

    async def fetch_blobs(self) -> None:
        """Reads the blobs the inputs up to the watermark reference and those
        tools returned, off the event loop, so building the context finds
        them in memory."""
        blobs = self.services.blobs
        if blobs is None:
            return
        wanted = T.referenced_blobs(self.facts, self.watermark)
        if wanted:
            await blobs.prefetch(self.lease.tenant_id, wanted)

    async def commit(self, kind: FactKind, data: Mapping[str, Any]) -> int:
        # An answer or result the ledger would refuse would fail every retry.
        data = fit_fact(data, self.services.max_fact_bytes)
        try:
            with tracing.span("keel.commit", self.trace_attributes, {"keel.fact.kind": kind}):
                appended = await self.services.ledger.append_one(
                    self.session_id, kind, data, epoch=self.epoch
                )
        except StaleEpoch as error:
            raise Fenced(str(error)) from None
        known = self.facts[-1].seq if self.facts else 0
        if not appended.duplicate and appended.seq == known + 1:
            # Nothing else was committed in between: our fact is exactly what
            # the ledger holds (bar its timestamp), no need to read it back.
            self.facts.append(
                CommittedFact(
                    self.session_id,
                    appended.seq,
                    kind,
                    dict(data),
                    int(time.time() * 1000),
                    self.epoch,
                )
            )
        else:
            # A duplicate (the ledger's copy wins) or client facts in between.
            await self.refresh()
        self.services.hub.committed(self.session_id, self.epoch, appended.seq)
        return appended.seq

    def status(self, state: SessionState) -> None:
        self.services.hub.publish(self.session_id, StatusChange(state, self.epoch))

    def boundary(self, point: str) -> None:
        """A commit boundary: crash tests stop here, handoffs end here."""
        faults.hit(point)
        if self.services.handoff_requested():
            raise HandoffStop(point)

    # -- the attempt --

    async def start(self) -> bool:
        """Fixes the watermark and raises the fence; False when nothing is owed."""
        # Claimed, nothing committed yet: a crash here leaves only a lease
        # (and its epoch) for the kernel to expire.
        faults.hit("after_claim")
        if not self.facts:
            await self.refresh()
        # Inputs and decisions both wake a session: read through the latest.
        self.watermark = T.read_through(self.facts)
        if T.owed(self.facts, self.watermark).nothing:
            # A wake-up that finds the work done (a cancel with nothing
            # running, a duplicate input): nothing to write, so no fence to
            # raise and no epoch fact to add to the session.
            return False
        self.resumed = _started_epoch(self.facts) == self.epoch
        if self.resumed:
            # A sticky session woken with the epoch it kept: its fence is up
            # already. The answers carry their own watermark instead.
            faults.hit("after_watermark")
            return True
        with tracing.span("keel.epoch_started", self.trace_attributes):
            await self.commit(
                EPOCH_STARTED,
                {
                    "epoch": self.epoch,
                    "runtimeId": self.services.runtime_id,
                    "attemptId": self.attempt_id,
                    "watermark": self.watermark,
                    # What GetContext needs to show this epoch's system prompt
                    # after the tenant has changed the loadout.
                    "loadoutRevision": self.loadout.revision,
                },
            )
        if self.lease.reclaimed:
            runner_metrics.takeover_first_commit((time.perf_counter() - self.began) * 1000)
        faults.hit("after_watermark")
        return True

    async def run_turns(self) -> None:
        """Turns until nothing up to the watermark is owed."""
        while True:
            owed = T.owed(self.facts, self.watermark)
            if owed.cancelled_input_seqs:
                await self.settle_cancelled(owed)
                continue
            if owed.open_calls:
                await self.run_tools(owed.open_calls)
                continue
            if not owed.input_seqs or owed.blocked:
                # Done, or every call left waits for a person: the inputs
                # stay owed until the decision wakes the session again.
                return
            await self.answer(owed)

    async def answer(self, owed: T.Owed) -> None:
        with tracing.span("keel.context_build", self.trace_attributes):
            await self.fetch_blobs()
            # Built once here; the compaction check and the request reuse it.
            self.context()
        compacted = await self.services.compaction.before_request(
            self, self.facts, overflowed=False
        )
        if compacted:
            self.boundary("after_compaction")
            return
        messages, messages_tokens = T.presented_request(self.context())
        generation = T.generation_id(owed.context_head_seq)
        request = ModelRequest(
            system=self.loadout.system_prompt,
            messages=messages,
            tools=self.tools.specs,
            max_output_tokens=self.loadout.max_output_tokens,
            attempt=self.lease.failures + 1,
            messages_tokens=messages_tokens,
            generation_id=generation,
        )
        try:
            with tracing.span(
                "keel.provider", self.trace_attributes, {"gen_ai.request.model": self.model_name}
            ) as provider_span:
                with self.provider_call.timing(self.provider.name) as call:
                    completed = await self.stream(request, generation)
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
            self.overflows_in_a_row += 1
            if self.overflows_in_a_row > 1:
                raise ProviderError(
                    "the context still overflows the model's window after compaction",
                    retryable=False,
                ) from None
            await self.services.compaction.before_request(self, self.facts, overflowed=True)
            return
        self.overflows_in_a_row = 0
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
        if self.resumed:
            # GetContext and compaction read a request's watermark from its
            # epoch's epoch_started, which an earlier turn wrote.
            data["watermark"] = self.watermark
        # Right before the write, with no await in between: a runner stopped
        # here sends this append first when it is resumed.
        faults.hit("before_final_answer" if final else "before_assistant_commit")
        with self.answering(owed.input_seqs if final else ()):
            await self.commit(ASSISTANT, data)
        if final:
            runner_metrics.turn_answered()
        if final and faults.injected("duplicate_reply"):
            await self.commit(ASSISTANT, {**data, "generationId": f"{generation}-again"})
        # The final answer's boundary is in the runtime, between it and Finish.
        self.boundary("after_final_answer" if final else "after_assistant_commit")

    async def stream(self, request: ModelRequest, generation: str) -> Completed:
        hub = self.services.hub
        session_id, epoch, attempt_id = self.session_id, self.epoch, self.attempt_id
        completed: Completed | None = None
        first = True
        # Some providers (OpenAI streaming) name a tool call only in its first
        # fragment; every partial names its call, so that a client can tell
        # parallel calls apart: index -> (call id, tool name).
        calls: dict[int, tuple[str, str]] = {}
        # Closed even when the attempt is abandoned mid-stream (cancel, lost
        # lease, handoff), so the provider's HTTP response is released at once.
        events = self.provider.stream(request)
        async with contextlib.aclosing(cast(AsyncGenerator[StreamEvent, None], events)) as stream:
            async for event in stream:
                if isinstance(event, TextDelta):
                    hub.publish(
                        session_id, Partial(generation, "text", event.text, epoch, attempt_id)
                    )
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
                    self.provider_call.first_event()
                    faults.hit("mid_stream")
        if completed is None:
            raise ProviderError("the model stream ended without an answer", retryable=True)
        return completed

    async def run_tools(self, calls: Sequence[T.OpenCall]) -> None:
        """Settles every open call: runs it (at-least-once) and commits its
        result, refuses it with an error result, or asks for approval."""
        for index, call in enumerate(calls):
            last = index == len(calls) - 1
            refusal = T.refusal(call)
            asks = refusal is None and call.decision is None
            if asks and self.tools.requires_approval(call.name):
                await self.commit(
                    APPROVAL_REQUESTED,
                    {
                        "toolCallId": call.tool_call_id,
                        "name": call.name,
                        "arguments": dict(call.arguments),
                    },
                )
                self.boundary("after_approval_requested")
                continue
            tool_call = ToolCall(
                call.tool_call_id,
                call.name,
                call.arguments,
                idempotency_key(self.lease.tenant_id, self.session_id, call.tool_call_id),
                session_id=self.session_id,
                tenant_id=self.lease.tenant_id,
            )
            if refusal is not None:
                outcome = ToolOutcome(refusal, is_error=True)
            else:
                with tracing.span(
                    "keel.tool",
                    self.trace_attributes,
                    {"keel.tool.name": call.name, "keel.tool.call_id": call.tool_call_id},
                ):
                    called = time.perf_counter()
                    outcome = await self.tools.run(tool_call)
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
            await self.commit(TOOL_RESULT, result)
            self.boundary("after_tool_results" if last else "after_some_tool_results")

    async def settle_cancelled(self, owed: T.Owed) -> None:
        """A client cancelled: close open calls (waiting ones too), consume
        what the cancel covers."""
        for call in (*owed.open_calls, *owed.waiting_calls):
            await self.commit(
                TOOL_RESULT,
                {"toolCallId": call.tool_call_id, "content": "cancelled", "isError": True},
            )
        # Calls closed, the cancelled inputs not yet consumed: a successor
        # must close the settlement without closing a call twice.
        faults.hit("mid_cancel")
        with self.answering(owed.cancelled_input_seqs):
            await self.commit(
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


# The kernel (or its database) away is said once per process, not once per
# lease and renewal (services.common.outage_log).
RENEWALS = OutageLog(log, "kernel", attempts="lease renewals failed")


async def renew_until_lost(
    kernel: KernelClient, lease: Lease, runtime_id: str, lease_ms: int, on_lost: Callable[[], None]
) -> None:
    """Renews on its own task so model or tool work can never starve it."""
    interval = max(lease_ms / 3000.0, 0.05)
    while True:
        await asyncio.sleep(interval)
        try:
            await kernel.renew(lease.session_id, lease.epoch, runtime_id)
        except (LeaseLost, EpochSuperseded):
            log.warning("lease of %s lost", lease.session_id)
            on_lost()
            return
        except ServiceUnavailable as error:  # the kernel is briefly away: try again
            RENEWALS.failed(error)
            continue
        except Exception:
            log.exception("lease renewal failed; retrying")
            continue
        RENEWALS.succeeded()


AttemptFactory = Callable[[Lease], Awaitable[Attempt]]


def _started_epoch(facts: Sequence[CommittedFact]) -> int:
    """The epoch of the session's latest `epoch_started` (0: none)."""
    for fact in reversed(facts):
        if fact.kind == EPOCH_STARTED:
            return int(fact.data["epoch"])
    return 0
