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

This module holds the attempt's state, its ledger access and its turn loop;
a model turn is services/runner/model_turn.py and the tool side of a turn
services/runner/tool_turn.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent_io.loadout import Loadout
from agent_io.providers import Completed, ModelRequest, Provider
from agent_io.tools import ToolRegistry
from compaction.policy import ContextEntry, MessageEntry
from kernel import EpochSuperseded, KernelClient, Lease, LeaseLost
from services.blob_parts import BlobContent
from services.common import faults, tracing
from services.common.config import DEFAULT_MAX_FACT_BYTES
from services.common.errors import ServiceUnavailable
from services.common.outage_log import OutageLog
from services.ledger import LedgerClient, Settlement, StaleEpoch
from services.ledger.facts import EPOCH_STARTED, FORKED_FROM, INPUT, CommittedFact, FactKind
from services.runner import metrics as runner_metrics
from services.runner import model_turn, tool_turn
from services.runner import transcript as T
from services.runner.events import SessionState
from services.runner.fact_fit import fit_fact
from services.runner.hub import PartialHub, StatusChange

log = logging.getLogger(__name__)


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
    # The sticky window a successful attempt asks for now (0: none).
    sticky_window: Callable[[], int] = lambda: 0


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
        # The end of the sticky window granted when the append of the final
        # answer settled the attempt with the kernel (the ledger did its
        # Finish in the same transaction); 0 until then, and where it did not.
        self.settled_until_ms = 0
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

    async def commit(self, kind: FactKind, data: Mapping[str, Any], *, last: bool = False) -> int:
        """Appends one fact under the attempt's epoch. `last`: the attempt's
        final answer, which carries the attempt's Finish when a sticky
        window is wanted, for the ledger to settle in the same transaction
        (`settled_until_ms` says whether it did)."""
        # An answer or result the ledger would refuse would fail every retry.
        data = fit_fact(data, self.services.max_fact_bytes)
        ledger = self.services.ledger
        settlement = self._settlement() if last else None
        try:
            with tracing.span("keel.commit", self.trace_attributes, {"keel.fact.kind": kind}):
                if settlement is None:
                    appended = await ledger.append_one(self.session_id, kind, data, self.epoch)
                else:
                    appended, self.settled_until_ms = await ledger.append_settling(
                        self.session_id, kind, data, self.epoch, settlement
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

    def _settlement(self) -> Settlement | None:
        """The Finish a successful end of this attempt sends (kernel Finish
        with `read_through` the watermark), if it asks for a window."""
        sticky_ms = self.services.sticky_window()
        if sticky_ms <= 0:
            return None
        return Settlement(self.services.runtime_id, self.watermark, sticky_ms)

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
        """One model turn (services/runner/model_turn.py)."""
        await model_turn.answer(self, owed)

    async def stream(self, request: ModelRequest, generation: str) -> Completed:
        return await model_turn.stream(self, request, generation)

    async def run_tools(self, calls: Sequence[T.OpenCall]) -> None:
        """Settles every open call: runs it (at-least-once) and commits its
        result, refuses it with an error result, or asks for approval
        (services/runner/tool_turn.py)."""
        await tool_turn.run_tools(self, calls)

    async def settle_cancelled(self, owed: T.Owed) -> None:
        """A client cancelled: close open calls (waiting ones too), consume
        what the cancel covers."""
        await tool_turn.settle_cancelled(self, owed)


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
    """The epoch of the session's latest `epoch_started` (0: none). A fork's
    copied facts are its parent's epochs, not its own: none before the
    `forked_from` counts."""
    for fact in reversed(facts):
        if fact.kind == EPOCH_STARTED:
            return int(fact.data["epoch"])
        if fact.kind == FORKED_FROM:
            return 0
    return 0
