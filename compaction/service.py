"""The compaction service's gRPC face: Plan, Compact and GetContext.

Everything is derived from the session's ledger facts and the tenant's
loadout, read per call: the service holds no state of its own, so any
replica (or the copy embedded in a runner) answers the same way.

Compact commits under the CALLER's epoch. The ledger's fence is the real
guard (a successor's epoch_started makes the append fail with STALE_EPOCH);
the early check against the session's fence only saves a model call that
could never be committed.

Which inputs a request presents depends on the attempt's read watermark
(inputs committed after it are answered by the next attempt), so Plan and
Compact use the watermark of the current epoch, and GetContext the one of
the epoch that committed the answer built at that point, with the system
prompt of the loadout revision that epoch pinned. Blobs the inputs reference
are resolved by the same code as the runner's (`services.blob_parts`), from
the same store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from agent_io.loadout import Loadout
from agent_io.providers import Provider, provider_from_loadout
from compaction import metrics as compaction_metrics
from compaction.errors import (
    BadLoadout,
    CompactionFenced,
    InvalidArgument,
    NoSessionToCompact,
    SeqPastHead,
)
from compaction.policy import (
    CompactionSettings,
    ContextEntry,
    Preparation,
    estimate_text_tokens,
    message_from_dict,
    plan_compaction,
    prepare,
    resolve_context_window,
    settings_from_dict,
    to_entries,
    tokens_after,
    would_reduce,
)
from compaction.policy.prompts import history_output_budget, turn_prefix_output_budget
from compaction.summarizer import summarize
from compaction.transcript import (
    BlobParts,
    context_entries,
    referenced_blobs,
    request_messages,
)
from keel.compaction.v1 import compaction_pb2 as pb
from keel.compaction.v1 import compaction_pb2_grpc as pb_grpc
from kernel import DEFAULT_LOADOUT, KernelClient, KernelError
from services.blob_parts import BlobContent
from services.blobs import blob_store
from services.common.config import Settings
from services.common.errors import unary_errors
from services.common.secrets import SecretPolicy
from services.ledger import LedgerClient, SessionNotFound, StaleEpoch
from services.ledger.errors import InvalidId
from services.ledger.facts import (
    ASSISTANT,
    COMPACTION,
    EPOCH_STARTED,
    INPUT,
    CommittedFact,
    check_id,
)
from services.ledger.views import SessionView

log = logging.getLogger(__name__)
Context = grpc.aio.ServicerContext[Any, Any]

REASONS = ("threshold", "overflow", "manual")
MAX_INSTRUCTIONS_CHARS = 4000
DEFAULT_CONTEXT_WINDOW = 128_000


def current_watermark(facts: Sequence[CommittedFact]) -> int | None:
    """The read watermark of the session's latest turn (None before any):
    its epoch_started's, or the one a later turn of a sticky session wrote
    on its answer or compaction."""
    for fact in reversed(facts):
        if fact.kind == EPOCH_STARTED:
            return int(fact.data["watermark"])
        if fact.kind in (ASSISTANT, COMPACTION) and fact.data.get("watermark") is not None:
            return int(fact.data["watermark"])
    return None


def answering_epoch(facts: Sequence[CommittedFact], context_head_seq: int) -> CommittedFact | None:
    """The `epoch_started` of the attempt that answered the request built at
    `context_head_seq` (the answer's generation id names that head), or None
    when no answer to it was committed."""
    generation = f"gen-{context_head_seq}"
    answer = next(
        (f for f in facts if f.kind == ASSISTANT and f.data.get("generationId") == generation),
        None,
    )
    if answer is None:
        return None
    for fact in reversed(facts):
        if (
            fact.kind == EPOCH_STARTED
            and fact.seq < answer.seq
            and fact.data.get("epoch") == answer.epoch
        ):
            return fact
    return None


def answer_watermark(facts: Sequence[CommittedFact], context_head_seq: int) -> int | None:
    """The watermark of the request built at `context_head_seq`, if an answer
    to it was committed; else None: a request built now from everything up to
    that point reads every input. An answer of a sticky session's later turn
    says its own (its epoch's epoch_started is an earlier turn's)."""
    generation = f"gen-{context_head_seq}"
    for fact in facts:
        if fact.kind == ASSISTANT and fact.data.get("generationId") == generation:
            if fact.data.get("watermark") is not None:
                return int(fact.data["watermark"])
            break
    epoch = answering_epoch(facts, context_head_seq)
    return None if epoch is None else int(epoch.data["watermark"])


def _seq(entries: Sequence[ContextEntry], position: int) -> int:
    seq = entries[position].seq
    assert seq is not None, "context entries built from facts carry their seq"
    return seq


def _hidden_input_before(
    facts: Sequence[CommittedFact], watermark: int | None, first_kept_seq: int
) -> int | None:
    """An input the attempt has not read (seq above its watermark) that lies
    before the first kept message. The compaction would neither summarize it
    (the attempt cannot see it) nor keep it, so the next attempt would lose
    it: such a compaction waits until the input has been read."""
    if watermark is None:
        return None
    for fact in facts:
        if fact.kind == INPUT and watermark < fact.seq < first_kept_seq:
            return fact.seq
    return None


class CompactionServicer(pb_grpc.CompactionServiceServicer):
    def __init__(
        self,
        ledger: LedgerClient,
        kernel: KernelClient,
        *,
        default_context_window: int = DEFAULT_CONTEXT_WINDOW,
        blob_settings: Settings | None = None,
        secrets: SecretPolicy | None = None,
    ) -> None:
        self._ledger = ledger
        self._kernel = kernel
        self._default_window = default_context_window
        # The blob store is opened at first use (opening it may create its
        # table, which must not block the event loop); None: no blobs shown.
        self._blob_settings = blob_settings
        self._blobs: BlobContent | None = None
        # Which secrets a tenant's summary model may read, and where it may
        # call: the operator's policy, as the runner applies it. By default
        # that of the deployment's Settings (the same as the runner's).
        if secrets is None:
            secrets = blob_settings.secrets if blob_settings is not None else SecretPolicy()
        self._secrets = secrets
        # One provider per tenant and model configuration, reused across
        # calls (real providers hold HTTP connection pools).
        self._providers: dict[str, Provider] = {}

    async def close(self) -> None:
        for provider in self._providers.values():
            await provider.aclose()
        self._providers.clear()

    # -- reading what a call needs --

    @staticmethod
    def _session_id(raw: str) -> str:
        try:
            return check_id(raw, "session_id")
        except InvalidId as error:
            raise InvalidArgument(error.message, field="session_id") from None

    async def _view(self, session_id: str) -> SessionView:
        try:
            return await self._ledger.get_session(session_id)
        except SessionNotFound:
            raise NoSessionToCompact(f"no session {session_id!r}", session_id=session_id) from None

    async def _loadout(self, tenant_id: str, revision: int | None = None) -> Loadout:
        """The tenant's current loadout, or the given revision of it."""
        if revision == 0:
            # Pinned while the tenant had no loadout stored: the default one
            # (asking the kernel for 0 would give today's latest).
            return Loadout.from_document(0, DEFAULT_LOADOUT)
        try:
            document = await self._kernel.get_loadout(tenant_id, revision or 0)
        except KernelError as error:
            raise BadLoadout(
                f"cannot read the loadout of tenant {tenant_id!r}: {error.message}",
                tenant_id=tenant_id,
            ) from None
        return Loadout.from_document(document.revision, document.document)

    async def _blob_parts(
        self, tenant_id: str, facts: Sequence[CommittedFact], watermark: int | None
    ) -> BlobParts | None:
        """The resolver of the blobs a request presents, with those blobs read
        (off the event loop) so resolving them does not block."""
        if self._blob_settings is None:
            return None
        if self._blobs is None:
            store = await asyncio.to_thread(blob_store, self._blob_settings)
            self._blobs = self._blobs or BlobContent(store)
        await self._blobs.prefetch(tenant_id, referenced_blobs(facts, watermark))
        return self._blobs.resolver(tenant_id)

    @staticmethod
    def _settings(loadout: Loadout) -> CompactionSettings:
        try:
            return settings_from_dict(loadout.compaction)
        except ValueError as error:
            raise BadLoadout(f"invalid compaction settings: {error}") from None

    def _provider(self, tenant_id: str, model: Mapping[str, Any]) -> Provider:
        # Per tenant: a provider holds the key its tenant was granted.
        key = json.dumps([tenant_id, model], sort_keys=True)
        provider = self._providers.get(key)
        if provider is None:
            try:
                provider = provider_from_loadout(model, tenant_id=tenant_id, secrets=self._secrets)
            except ValueError as error:
                raise BadLoadout(f"invalid model configuration: {error}") from None
            self._providers[key] = provider
        return provider

    # -- the RPCs --

    @unary_errors
    async def Plan(self, request: pb.PlanRequest, context: Context) -> pb.PlanResponse:
        session_id = self._session_id(request.session_id)
        view = await self._view(session_id)
        loadout = await self._loadout(view.tenant_id)
        settings = self._settings(loadout)
        provider = self._provider(view.tenant_id, loadout.model)
        facts = await self._ledger.read_all(session_id)
        watermark = current_watermark(facts)
        blob_parts = await self._blob_parts(view.tenant_id, facts, watermark)
        entries = to_entries(context_entries(facts, watermark, blob_parts))
        window = resolve_context_window(provider.context_window, self._default_window)
        plan = plan_compaction(entries, settings, window)
        response = pb.PlanResponse(
            should_compact=plan.should_compact,
            can_compact=plan.preparation is not None,
            tokens_before=plan.context_tokens,
            tokens_after=plan.context_tokens,
            context_window=window,
        )
        preparation = plan.preparation
        if preparation is not None:
            first, last = self._covered(entries, preparation)
            response.first_kept_seq = _seq(entries, preparation.first_kept_index)
            response.summarized_from_seq = first
            response.summarized_to_seq = last
            response.is_split_turn = preparation.is_split_turn
            # Before the summary exists only its ceiling is known: the kept
            # messages plus the most the summary calls may write.
            ceiling = history_output_budget(settings) if preparation.summarize_indices else 0
            if preparation.prefix_indices:
                ceiling += turn_prefix_output_budget(settings)
            response.tokens_after = preparation.tokens_kept + ceiling
        return response

    @unary_errors
    async def Compact(self, request: pb.CompactRequest, context: Context) -> pb.CompactResponse:
        started = time.perf_counter()
        session_id = self._session_id(request.session_id)
        if request.epoch <= 0:
            raise InvalidArgument(
                f"epoch must be the caller's epoch (> 0), got {request.epoch}", field="epoch"
            )
        reason = request.reason or "manual"
        if reason not in REASONS:
            raise InvalidArgument(
                f"reason must be one of {', '.join(REASONS)}, got {reason[:64]!r}", field="reason"
            )
        if len(request.instructions) > MAX_INSTRUCTIONS_CHARS:
            raise InvalidArgument(
                f"instructions must be at most {MAX_INSTRUCTIONS_CHARS} characters",
                field="instructions",
            )
        view = await self._view(session_id)
        self._check_epoch(request.epoch, view.fence_epoch)
        loadout = await self._loadout(view.tenant_id)
        settings = self._settings(loadout)
        if not settings.enabled and reason != "manual":
            return pb.CompactResponse(skipped_reason="compaction is disabled for this tenant")
        facts = await self._ledger.read_all(session_id)
        if request.watermark < 0:
            raise InvalidArgument(
                f"watermark must be >= 0, got {request.watermark}", field="watermark"
            )
        watermark = request.watermark or current_watermark(facts)
        blob_parts = await self._blob_parts(view.tenant_id, facts, watermark)
        entries = to_entries(context_entries(facts, watermark, blob_parts))
        preparation = prepare(entries, settings)
        if preparation is None:
            return pb.CompactResponse(skipped_reason="nothing to compact")
        first_kept = _seq(entries, preparation.first_kept_index)
        hidden = _hidden_input_before(facts, watermark, first_kept)
        if hidden is not None:
            return pb.CompactResponse(
                skipped_reason=f"input {hidden} arrived after this attempt read its inputs and "
                "would fall outside the compacted context; the next attempt compacts"
            )

        summary = await summarize(
            self._provider(view.tenant_id, loadout.model),
            preparation,
            settings,
            focus=request.instructions,
            max_output_tokens=loadout.max_output_tokens,
        )
        after = tokens_after(preparation, summary.text)
        if not would_reduce(preparation, summary.text):
            return pb.CompactResponse(
                summary=summary.text,
                tokens_before=preparation.tokens_before,
                tokens_after=after,
                skipped_reason=f"the summary would not reduce the context "
                f"({preparation.tokens_before} -> {after} tokens)",
            )
        first, last = self._covered(entries, preparation)
        data = {
            "summary": summary.text,
            "firstKept": first_kept,
            "summarized": [first, last],
            "tokensBefore": preparation.tokens_before,
            "tokensAfter": after,
            "timestamp": int(time.time() * 1000),
            "reason": reason,
            "isSplitTurn": preparation.is_split_turn,
        }
        if request.watermark:
            # Where the inputs it read go in the transcript (see
            # compaction.transcript): its epoch_started is an earlier turn's.
            data["watermark"] = request.watermark
        try:
            appended = await self._ledger.append_one(session_id, COMPACTION, data, request.epoch)
        except StaleEpoch as error:
            raise CompactionFenced(
                f"the compaction was not committed: {error.message}",
                epoch=str(request.epoch),
            ) from None
        log.info(
            "compacted %s at seq %d (%s): %d -> %d tokens, kept from seq %d",
            session_id,
            appended.seq,
            reason,
            preparation.tokens_before,
            after,
            first_kept,
        )
        compaction_metrics.compacted(reason, started, preparation.tokens_before, after)
        return pb.CompactResponse(
            compacted=True,
            seq=appended.seq,
            summary=summary.text,
            tokens_before=preparation.tokens_before,
            tokens_after=after,
        )

    @unary_errors
    async def GetContext(
        self, request: pb.GetContextRequest, context: Context
    ) -> pb.GetContextResponse:
        started = time.perf_counter()
        session_id = self._session_id(request.session_id)
        if request.at_seq < 0:
            raise InvalidArgument(
                f"at_seq must be >= 0 (0 = the head), got {request.at_seq}", field="at_seq"
            )
        view = await self._view(session_id)
        at_seq = request.at_seq or view.head_seq
        if at_seq > view.head_seq:
            raise SeqPastHead(
                f"at_seq {at_seq} is past the session's head {view.head_seq}",
                head_seq=str(view.head_seq),
            )
        facts = await self._ledger.read_all(session_id)
        upto = [fact for fact in facts if fact.seq <= at_seq]
        # The request built at at_seq is known exactly once answered: the
        # answering epoch fixed the inputs it read and the loadout it used.
        epoch = answering_epoch(facts, at_seq)
        watermark = answer_watermark(facts, at_seq)
        pinned = None if epoch is None else epoch.data.get("loadoutRevision")
        loadout = await self._loadout(view.tenant_id, pinned)
        blob_parts = await self._blob_parts(view.tenant_id, upto, watermark)
        messages = request_messages(upto, watermark, blob_parts)
        estimate = estimate_text_tokens(loadout.system_prompt) + sum(
            message_from_dict(message).tokens for message in messages
        )
        compaction_metrics.context_built(started)
        return pb.GetContextResponse(
            messages_json=json.dumps(list(messages), ensure_ascii=False),
            system_prompt=loadout.system_prompt,
            compaction_seq=max((f.seq for f in upto if f.kind == COMPACTION), default=0),
            estimated_tokens=estimate,
            loadout_revision=loadout.revision,
            # Not answered yet: the next request reads every input up to here.
            watermark=max((f.seq for f in upto if f.kind == INPUT), default=0)
            if watermark is None
            else watermark,
        )

    # -- helpers --

    @staticmethod
    def _check_epoch(epoch: int, fence: int) -> None:
        if epoch != fence:
            raise CompactionFenced(
                f"epoch {epoch} is not the session's current epoch {fence}; "
                "a newer attempt owns the session",
                epoch=str(epoch),
                fence=str(fence),
            )

    @staticmethod
    def _covered(entries: Sequence[ContextEntry], preparation: Preparation) -> tuple[int, int]:
        """The ledger seq range the new summary stands for: from the previous
        compaction's first kept message (its summary is carried forward) to
        the last message summarized now."""
        seqs = [_seq(entries, position) for position in preparation.covered_indices]
        return min(seqs), max(seqs)
