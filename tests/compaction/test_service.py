"""The compaction service over real gRPC, on PostgreSQL.

Sessions are written fact by fact through the real ledger (as a runner would
write them), so each test controls exactly what there is to compact.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

import compaction.service
from agent_io.providers import (
    Completed,
    ModelRequest,
    ProviderError,
    StreamEvent,
    Usage,
)
from agent_io.providers.scripted import long_text
from compaction.client import CompactionClient
from compaction.errors import (
    CompactionFenced,
    InvalidArgument,
    NoSessionToCompact,
    SeqPastHead,
    SummaryFailed,
)
from compaction.policy import (
    SUMMARY_INTRO,
    Preparation,
    estimate_text_tokens,
    message_from_dict,
    prepare,
    settings_from_dict,
    to_entries,
)
from compaction.policy.prompts import TURN_CONTEXT_HEADING
from compaction.server import CompactionServer
from compaction.summarizer import summarize
from compaction.transcript import context_head
from keel.compaction.v1 import compaction_pb2 as pb
from keel.compaction.v1 import compaction_pb2_grpc as pb_grpc
from services.blobs import blob_store
from services.common.config import Settings
from services.ledger import CommittedFact, LedgerClient
from tests.support.blobs import PNG, store_blob
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.internal_auth import token_metadata

TENANT = "svc-tenant"
SYSTEM = "You are a compaction test."
LOADOUT: dict[str, Any] = {
    "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": 3000},
    "systemPrompt": SYSTEM,
    "compaction": {"enabled": True, "keepRecentTokens": 200, "reserveTokens": 1000},
}


@dataclass
class Stack:
    cluster: Cluster
    server: CompactionServer
    client: CompactionClient


@pytest.fixture
async def stack(pg_settings: Settings) -> AsyncIterator[Stack]:
    cluster = await start_cluster(pg_settings)
    server = await CompactionServer(
        pg_settings, cluster.ledger_server.target, cluster.kernel_server.target
    ).start()
    client = CompactionClient(server.target, pg_settings)
    try:
        await cluster.kernel.create_tenant(TENANT)
        await cluster.kernel.put_loadout(TENANT, LOADOUT)
        yield Stack(cluster, server, client)
    finally:
        await client.close()
        await server.stop()
        await stop_cluster(cluster)


@dataclass
class Writer:
    """Writes a session the way a runner does: each turn is an input, a new
    epoch that reads it, and the answer under that epoch."""

    ledger: LedgerClient
    session_id: str
    epoch: int = 0
    watermark: int = 0
    requests: int = 0
    owed: list[int] = field(default_factory=list)
    # Written into epoch_started as the revision the attempt pinned, if set.
    loadout_revision: int | None = None

    async def user(self, text: str, blobs: Sequence[str] = ()) -> int:
        self.requests += 1
        data: dict[str, Any] = {"text": text, "requestId": f"r{self.requests}"}
        if blobs:
            data["blobs"] = list(blobs)
        appended = await self.ledger.append_one(self.session_id, "input", data)
        self.owed.append(appended.seq)
        return appended.seq

    async def claim(self) -> None:
        """A new epoch reading every input so far."""
        self.epoch += 1
        facts = await self.ledger.read_all(self.session_id)
        self.watermark = max(f.seq for f in facts if f.kind == "input")
        data = {
            "epoch": self.epoch,
            "runtimeId": "rt",
            "attemptId": "a",
            "watermark": self.watermark,
        }
        if self.loadout_revision is not None:
            data["loadoutRevision"] = self.loadout_revision
        await self.write("epoch_started", data)

    async def answer(self, text: str, tool_calls: Sequence[dict[str, Any]] = ()) -> int:
        facts = await self.ledger.read_all(self.session_id)
        data: dict[str, Any] = {
            "generationId": f"gen-{context_head(facts, self.watermark)}",
            "content": [{"type": "text", "text": text}],
            "toolCalls": list(tool_calls),
        }
        if not tool_calls:
            data["inputSeqs"], self.owed = self.owed, []
        return await self.write("assistant", data)

    async def tool_result(self, call_id: str, content: str) -> int:
        return await self.write("tool_result", {"toolCallId": call_id, "content": content})

    async def turn(self, question: str, reply: str, blobs: Sequence[str] = ()) -> tuple[int, int]:
        asked = await self.user(question, blobs)
        await self.claim()
        return asked, await self.answer(reply)

    async def write(self, kind: str, data: dict[str, Any]) -> int:
        appended = await self.ledger.append_one(self.session_id, kind, data, epoch=self.epoch)
        return appended.seq


async def new_session(stack: Stack, session_id: str) -> Writer:
    await stack.cluster.ledger.create_session(session_id, TENANT)
    return Writer(stack.cluster.ledger, session_id)


async def compactions(stack: Stack, session_id: str) -> list[CommittedFact]:
    return [f for f in await stack.cluster.facts(session_id) if f.kind == "compaction"]


def texts(messages: Sequence[Any]) -> list[str]:
    out = []
    for message in messages:
        content = message["content"]
        out.append(content if isinstance(content, str) else content[0]["text"])
    return out


async def test_compact_commits_a_consistent_fact_and_updates_it_later(stack: Stack) -> None:
    writer = await new_session(stack, "long")
    turns = [await writer.turn(f"q{i} " + long_text(300), f"noted {i}") for i in range(8)]

    plan = await stack.client.plan("long")
    assert plan.should_compact and plan.can_compact
    assert plan.context_window == 3000
    # keepRecentTokens=200 is crossed at the last (300-token) question: a clean cut.
    assert plan.first_kept_seq == turns[-1][0]
    assert (plan.summarized_from_seq, plan.summarized_to_seq) == (turns[0][0], turns[-2][1])
    assert not plan.is_split_turn

    result = await stack.client.compact("long", writer.epoch, "threshold")
    assert result.compacted and result.tokens_after < result.tokens_before
    [fact] = await compactions(stack, "long")
    assert fact.seq == result.seq and fact.epoch == writer.epoch
    assert fact.data["firstKept"] == plan.first_kept_seq
    assert fact.data["summarized"] == [turns[0][0], turns[-2][1]]
    assert fact.data["tokensBefore"] == result.tokens_before == plan.tokens_before
    assert fact.data["reason"] == "threshold" and fact.data["summary"] == result.summary
    assert fact.data["timestamp"] > 0

    # The context now presents the summary, then the kept turn.
    context = await stack.client.get_context("long")
    assert context.system_prompt == SYSTEM and context.compaction_seq == fact.seq
    assert context.messages[0]["content"].startswith(SUMMARY_INTRO)
    assert texts(context.messages[1:]) == [f"q7 {long_text(300)}", "noted 7"]
    assert context.estimated_tokens == estimate_text_tokens(SYSTEM) + sum(
        message_from_dict(m).tokens for m in context.messages
    )
    # Before the compaction, every message was presented as it was written.
    before = await stack.client.get_context("long", fact.seq - 1)
    assert len(before.messages) == 16 and before.compaction_seq == 0

    # Nothing new: nothing to compact (the newest entry is the compaction).
    skipped = await stack.client.compact("long", writer.epoch)
    assert not skipped.compacted and skipped.skipped_reason == "nothing to compact"

    more = [await writer.turn(f"r{i} " + long_text(300), f"again {i}") for i in range(3)]
    second = await stack.client.compact("long", writer.epoch)
    assert second.compacted
    assert "Carried the previous checkpoint forward." in second.summary
    facts = await compactions(stack, "long")
    assert len(facts) == 2
    # The new range starts at the previous first kept message, never after it.
    assert facts[1].data["summarized"] == [turns[-1][0], more[-2][1]]
    assert facts[1].data["firstKept"] == more[-1][0]
    head = await stack.client.get_context("long")
    assert head.compaction_seq == facts[1].seq
    assert texts(head.messages[1:]) == [f"r2 {long_text(300)}", "again 2"]


async def test_a_split_turn_summarizes_the_turn_prefix(stack: Stack) -> None:
    writer = await new_session(stack, "split")
    asked = await writer.user("start")
    await writer.claim()
    call = {"id": "c1", "name": "clock", "arguments": {}}
    await writer.answer("calling", [call])
    result_seq = await writer.tool_result("c1", long_text(400))
    final = await writer.answer(long_text(300))
    await stack.cluster.kernel.put_loadout(
        TENANT, {**LOADOUT, "compaction": {"keepRecentTokens": 350, "reserveTokens": 1000}}
    )

    result = await stack.client.compact("split", writer.epoch)
    assert result.compacted
    [fact] = await compactions(stack, "split")
    assert fact.data["firstKept"] == final and fact.data["isSplitTurn"] is True
    assert fact.data["summarized"] == [asked, result_seq]
    assert TURN_CONTEXT_HEADING in fact.data["summary"]


async def test_a_summary_that_would_not_reduce_is_not_committed(stack: Stack) -> None:
    writer = await new_session(stack, "tiny")
    for i in range(4):
        await writer.turn(f"hi {i}", "ok")
    await stack.cluster.kernel.put_loadout(
        TENANT, {**LOADOUT, "compaction": {"keepRecentTokens": 1, "reserveTokens": 1000}}
    )
    result = await stack.client.compact("tiny", writer.epoch)
    assert not result.compacted and result.not_reduced
    assert "would not reduce" in result.skipped_reason
    assert result.tokens_after >= result.tokens_before
    assert await compactions(stack, "tiny") == []


async def test_a_failed_summary_commits_nothing(stack: Stack) -> None:
    writer = await new_session(stack, "fails")
    await writer.turn("/failsummary " + long_text(300), "noted")
    await writer.turn(long_text(300), "noted again")
    with pytest.raises(SummaryFailed, match="scripted summary failure") as caught:
        await stack.client.compact("fails", writer.epoch)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert await compactions(stack, "fails") == []


async def test_a_stale_epoch_cannot_commit(stack: Stack) -> None:
    writer = await new_session(stack, "stale")
    for i in range(4):
        await writer.turn(f"q{i} " + long_text(300), "ok")
    old_epoch = writer.epoch
    await writer.claim()  # a successor's epoch_started raises the fence
    with pytest.raises(CompactionFenced) as caught:
        await stack.client.compact("stale", old_epoch)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.reason == "STALE_EPOCH"
    assert await compactions(stack, "stale") == []


async def test_the_ledger_fences_a_compaction_overtaken_while_summarizing(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The epoch is current when Compact starts, and a successor claims the
    session while the summary is being written: the ledger refuses the fact."""
    writer = await new_session(stack, "overtaken")
    for i in range(4):
        await writer.turn(f"q{i} " + long_text(300), "ok")

    async def overtaken(*args: Any, **kwargs: Any) -> Any:
        await writer.claim()
        return await summarize(*args, **kwargs)

    monkeypatch.setattr(compaction.service, "summarize", overtaken)
    with pytest.raises(CompactionFenced, match="not committed"):
        await stack.client.compact("overtaken", writer.epoch)
    assert await compactions(stack, "overtaken") == []


async def test_context_at_a_seq_uses_the_answering_epochs_watermark(stack: Stack) -> None:
    """An input committed while an attempt ran is not in that attempt's
    requests, and is in the next attempt's."""
    writer = await new_session(stack, "late")
    first = await writer.user("first")
    await writer.claim()
    late = await writer.user("late")
    call = {"id": "c1", "name": "clock", "arguments": {}}
    calling = await writer.answer("calling", [call])
    result_seq = await writer.tool_result("c1", "12:00")
    writer.owed = [first]
    await writer.answer("it is noon")
    writer.owed = [late]
    await writer.claim()
    await writer.answer("you said late")

    at_first = await stack.client.get_context("late", first)
    assert texts(at_first.messages) == ["first"]
    at_result = await stack.client.get_context("late", result_seq)
    assert [m["role"] for m in at_result.messages] == ["user", "assistant", "toolResult"]
    assert "late" not in json.dumps(at_result.messages)
    # The next request: the answer to "first" came before "late" was read,
    # so "late" follows that answer.
    after = await stack.client.get_context("late", result_seq + 1)
    assert [m["role"] for m in after.messages] == [
        "user",
        "assistant",
        "toolResult",
        "assistant",
        "user",
    ]
    assert texts(after.messages)[-1] == "late"
    assert calling < result_seq


async def test_context_of_an_answer_is_what_its_attempt_was_shown(stack: Stack) -> None:
    """The answering epoch fixes the inputs (its watermark) and the system
    prompt (the loadout revision it pinned): neither a later input nor a
    later loadout changes what GetContext says that request showed."""
    pinned = (await stack.cluster.kernel.get_loadout(TENANT)).revision
    writer = await new_session(stack, "pinned")
    writer.loadout_revision = pinned
    first = await writer.user("/tool clock")
    await writer.claim()
    await writer.answer("calling", [{"id": "c1", "name": "clock", "arguments": {}}])
    await writer.user("arrived mid-attempt")
    result_seq = await writer.tool_result("c1", "12:00")
    writer.owed = [first]
    await writer.answer("it is noon")

    shown = await stack.client.get_context("pinned", result_seq)
    assert shown.system_prompt == SYSTEM
    assert shown.loadout_revision == pinned and shown.watermark == first
    assert [m["role"] for m in shown.messages] == ["user", "assistant", "toolResult"]
    assert "arrived mid-attempt" not in json.dumps(shown.messages)

    await stack.cluster.kernel.put_loadout(TENANT, {**LOADOUT, "systemPrompt": "Be new."})
    assert await stack.client.get_context("pinned", result_seq) == shown
    # What a request built now would show: today's loadout, every input (the
    # watermark says so: the latest input).
    now = await stack.client.get_context("pinned")
    assert now.system_prompt == "Be new." and now.loadout_revision > pinned
    assert texts(now.messages)[-1] == "arrived mid-attempt"
    facts = await stack.cluster.ledger.read_all("pinned")
    assert now.watermark == max(f.seq for f in facts if f.kind == "input")


async def test_context_pinned_before_any_loadout_shows_the_default_one(stack: Stack) -> None:
    await stack.cluster.kernel.create_tenant("bare")
    await stack.cluster.ledger.create_session("bare-1", "bare")
    writer = Writer(stack.cluster.ledger, "bare-1", loadout_revision=0)
    asked, _ = await writer.turn("hello", "hi")
    default = await stack.client.get_context("bare-1", asked)
    await stack.cluster.kernel.put_loadout("bare", {**LOADOUT, "systemPrompt": "Later."})
    assert await stack.client.get_context("bare-1", asked) == default
    assert default.loadout_revision == 0 and default.system_prompt != "Later."


async def test_context_shows_an_inputs_blobs(stack: Stack) -> None:
    store = blob_store(stack.cluster.settings)
    image = store_blob(store, PNG, "image/png", tenant=TENANT)
    notes = store_blob(store, b"line one\nline two\n", "text/plain", tenant=TENANT)
    elsewhere = store_blob(store, b"not yours", "text/plain", tenant="another-tenant")
    writer = await new_session(stack, "blobs")
    asked, _ = await writer.turn("look", "seen", [image, notes, elsewhere])

    (message,) = (await stack.client.get_context("blobs", asked)).messages
    assert message["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image", "data": base64.b64encode(PNG).decode(), "mimeType": "image/png"},
        {"type": "text", "text": f"Attachment {notes} (text/plain):\nline one\nline two\n"},
        {"type": "text", "text": f"[Attachment {elsewhere} is not available.]"},
    ]


async def test_bad_requests_get_clear_status_codes(stack: Stack) -> None:
    writer = await new_session(stack, "known")
    await writer.turn("hello", "hi")
    head = (await stack.cluster.ledger.get_session("known")).head_seq
    client = stack.client

    unknown: list[Callable[[], Awaitable[object]]] = [
        lambda: client.plan("nope"),
        lambda: client.compact("nope", 1),
        lambda: client.get_context("nope"),
    ]
    for call in unknown:
        with pytest.raises(NoSessionToCompact):
            await call()
    malformed: list[Callable[[], Awaitable[object]]] = [
        lambda: client.plan("bad id!"),
        lambda: client.plan(""),
        lambda: client.compact("bad id!", 1),
        lambda: client.get_context("x" * 200),
        lambda: client.get_context("known", -1),
        lambda: client.compact("known", 0),
        lambda: client.compact("known", -3),
        lambda: client.compact("known", writer.epoch, reason="whenever"),
        lambda: client.compact("known", writer.epoch, instructions="x" * 5000),
    ]
    for call in malformed:
        with pytest.raises(InvalidArgument) as caught:
            await call()
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(SeqPastHead, match="past the session's head"):
        await client.get_context("known", head + 1)

    # The wire status codes themselves, as any gRPC client (holding the
    # internal token) sees them.
    auth = token_metadata()
    async with grpc.aio.insecure_channel(stack.server.target) as channel:
        stub = pb_grpc.CompactionServiceStub(channel)
        expected: list[tuple[Callable[[], Awaitable[object]], grpc.StatusCode]] = [
            (
                lambda: stub.Plan(pb.PlanRequest(session_id="nope"), metadata=auth),
                grpc.StatusCode.NOT_FOUND,
            ),
            (
                lambda: stub.GetContext(
                    pb.GetContextRequest(session_id="known", at_seq=-1), metadata=auth
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            (
                lambda: stub.GetContext(
                    pb.GetContextRequest(session_id="known", at_seq=head + 5), metadata=auth
                ),
                grpc.StatusCode.OUT_OF_RANGE,
            ),
            (
                lambda: stub.Compact(
                    pb.CompactRequest(session_id="known", epoch=writer.epoch + 1), metadata=auth
                ),
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
        ]
        for call, code in expected:
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                await call()
            assert raw.value.code() == code, raw.value.details()


class RecordingModel:
    """A provider that answers every summary request at once and keeps them."""

    name = "recording"
    model = "recording-1"
    context_window = 100_000

    def __init__(self, fail: bool = False) -> None:
        self.requests: list[ModelRequest] = []
        self.fail = fail

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        self.requests.append(request)
        if self.fail and "Original Request" in request.messages[0]["content"]:
            raise ProviderError("prefix model down", retryable=True)
        text = f"summary #{len(self.requests)}"
        yield Completed(({"type": "text", "text": text},), (), Usage(), "stop", self.model)

    async def aclose(self) -> None:
        pass


def split_turn_after_a_compaction() -> Preparation:
    """U A [compaction keeping from the 2nd U] U A U A(call) TR A, cut inside the last turn."""

    def message(role: str, text: str) -> dict[str, Any]:
        return {"type": "message", "message": {"role": role, "content": text}}

    raw = [
        message("user", "old question"),
        message("assistant", "old answer"),
        message("user", "kept question " + long_text(50)),
        {"type": "compaction", "summary": "PREVIOUS SUMMARY", "firstKeptIndex": 2},
        message("assistant", "kept answer " + long_text(50)),
        message("user", "last question"),
        {
            "type": "message",
            "message": {
                "role": "assistant",
                "content": [{"type": "toolCall", "id": "c1", "name": "clock", "arguments": {}}],
            },
        },
        {
            "type": "message",
            "message": {"role": "toolResult", "toolCallId": "c1", "content": long_text(200)},
        },
        message("assistant", long_text(100)),
    ]
    preparation = prepare(to_entries(raw), settings_from_dict({"keepRecentTokens": 150}))
    assert preparation is not None and preparation.is_split_turn
    return preparation


async def test_the_summarizer_updates_the_previous_summary_within_budget() -> None:
    model = RecordingModel()
    settings = settings_from_dict({"reserveTokens": 1000})
    summary = await summarize(
        model, split_turn_after_a_compaction(), settings, focus="the clock", max_output_tokens=600
    )
    history, prefix = model.requests
    assert all(r.purpose == "summary" for r in model.requests)
    # 0.8 x reserveTokens for the history, capped by the model's maximum;
    # 0.5 x reserveTokens for the turn prefix.
    assert (history.max_output_tokens, prefix.max_output_tokens) == (600, 500)
    history_prompt = history.messages[0]["content"]
    assert "<previous-summary>\nPREVIOUS SUMMARY\n</previous-summary>" in history_prompt
    assert "Update the checkpoint" in history_prompt
    assert "[User]: kept question" in history_prompt
    assert "[Tool result]" not in history_prompt
    assert "[User]: last question" in prefix.messages[0]["content"]
    assert "[Assistant tool calls]: clock()" in prefix.messages[0]["content"]
    for request in model.requests:
        assert "pay particular attention to: the clock" in request.messages[0]["content"]
    assert summary.model_calls == 2
    assert summary.text.startswith("summary #1")
    assert f"{TURN_CONTEXT_HEADING}\n\nsummary #2" in summary.text


async def test_a_failed_turn_prefix_fails_the_whole_summary() -> None:
    model = RecordingModel(fail=True)
    with pytest.raises(SummaryFailed, match="prefix model down") as caught:
        await summarize(model, split_turn_after_a_compaction(), settings_from_dict({}))
    assert caught.value.metadata == {"retryable": "true"}
