"""One trace per turn, across processes; and gRPC instrumentation only when
spans go somewhere.

`keel up --processes` runs each service in its own OS process, every one
exporting to a real OTLP collector the test runs. A turn's trace starts at
the input's POST; the attempt that answers continues it from the
`traceparent` stored with the input, so one trace id holds the edge's,
kernel's, ledger's and runner's spans, the provider call among them, each
span's parent in the trace. After a runner is SIGKILLed mid-answer, its
successor (a new process) reads the same traceparent from the ledger and
answers in the input's trace; an input that arrived meanwhile, answered by
the same attempt, is a link.

With the default `KEEL_OTEL_EXPORTER=none` the gRPC instrumentation would
cost every internal call without anyone ever seeing a span.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from services.common.config import Settings
from services.common.serving import open_channel
from tests.support.internal_auth import TEST_TOKEN
from tests.support.keel_up import RunningKeel, child_pid, keel_up
from tests.support.otlp_collector import OtlpCollector, ReceivedSpan, input_post_spans
from tests.support.polling import eventually

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow

KEY = "tracing-test-key-0123456789abcdef"
# A successor takes a killed runner's session over within about this.
LEASE_MS = 2000
TURN_SPANS: tuple[str, ...] = (
    "keel.claim",
    "keel.epoch_started",
    "keel.context_build",
    "keel.provider",
)
TURN_SPANS += ("keel.tool", "keel.commit", "keel.finish")


@pytest.mark.parametrize(("exporter", "traced"), [("none", False), ("console", True)])
async def test_channels_are_instrumented_only_when_spans_go_somewhere(
    exporter: str, traced: bool
) -> None:
    settings = Settings.from_env({"KEEL_OTEL_EXPORTER": exporter})
    assert settings.tracing is traced
    channel = open_channel("127.0.0.1:1", settings)
    try:
        assert bool(channel._unary_unary_interceptors) is traced  # type: ignore[attr-defined]
    finally:
        await channel.close(None)


KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


@pytest.mark.parametrize("exporter", ["none", "console"])
async def test_the_internal_token_is_sent_on_every_kind_of_call(exporter: str) -> None:
    """grpc.aio files each interceptor under one call kind only: a single
    class for several kinds would leave streaming calls without the token."""
    settings = Settings.from_env(
        {"KEEL_INTERNAL_TOKEN": TEST_TOKEN, "KEEL_OTEL_EXPORTER": exporter}
    )
    channel = open_channel("127.0.0.1:1", settings)
    try:
        for kind in KINDS:
            interceptors = getattr(channel, f"_{kind}_interceptors")
            carriers = [i for i in interceptors if type(i).__module__.endswith("internal_auth")]
            assert len(carriers) == 1, (kind, interceptors)
            assert carriers[0]._token == TEST_TOKEN
    finally:
        await channel.close(None)


async def test_no_token_no_token_interceptor() -> None:
    channel = open_channel("127.0.0.1:1", Settings())
    try:
        for kind in KINDS:
            assert getattr(channel, f"_{kind}_interceptors") == [], kind
    finally:
        await channel.close(None)


# ------------------------------------------------------- one trace per turn


class TracedKeel:
    def __init__(self, up: RunningKeel, collector: OtlpCollector, trigger: Path) -> None:
        self.up = up
        self.collector = collector
        # Written, it stops the first runner that reaches the point it names.
        self.trigger = trigger

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.up.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        )


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedKeel]:
    collector = OtlpCollector().start()
    data = tmp_path_factory.mktemp("traced")
    trigger = data / "fault-trigger"
    env = {**collector.env(), "KEEL_LEASE_MS": str(LEASE_MS), "KEEL_FAULT_TRIGGER": str(trigger)}
    try:
        with keel_up(data / "keel", KEY, "--processes", env=env) as up:
            yield TracedKeel(up, collector, trigger)
    finally:
        collector.stop()


async def _post_input(http: httpx.AsyncClient, session: str, text: str) -> int:
    posted = await http.post(f"/v1/sessions/{session}/inputs", json={"text": text})
    assert posted.status_code == 202, posted.text
    seq: int = posted.json()["seq"]
    return seq


async def _answered(http: httpx.AsyncClient, session: str, seq: int) -> list[dict[str, Any]]:
    async def facts() -> list[dict[str, Any]] | None:
        page = (await http.get(f"/v1/sessions/{session}/events?format=json")).json()
        found: list[dict[str, Any]] = page["facts"]
        done = any(
            f["kind"] == "assistant" and seq in f["data"].get("inputSeqs", []) for f in found
        )
        return found if done else None

    return await eventually(facts, f"an answer to input {seq}", 60)


async def _trace_of_turn(
    collector: OtlpCollector, session: str, posts: int, finished_attempts: int
) -> tuple[list[ReceivedSpan], list[ReceivedSpan]]:
    """The POST spans of `session` and the trace of its first, once it holds
    `finished_attempts` ended attempt spans and their kernel Finish calls."""

    async def complete() -> tuple[list[ReceivedSpan], list[ReceivedSpan]] | None:
        roots = input_post_spans(collector, session)
        if len(roots) < posts:
            return None
        trace = collector.trace(roots[0].trace_id)
        names = [(s.service, s.name) for s in trace]
        attempts = names.count(("keel-runner", "keel.attempt"))
        finishes = sum(1 for svc, name in names if svc == "keel-kernel" and name.endswith("Finish"))
        ids = {s.span_id for s in trace}
        # Spans are exported by each process on its own schedule: wait for
        # the children a finished attempt made in the other services too.
        others = [s for s in trace if s.service != "keel-runner" and s.parent_span_id]
        settled = all(s.parent_span_id in ids for s in others)
        # The ledger's span of each commit (and of the input's own append).
        appends = sum(1 for svc, name in names if svc == "keel-ledger" and name.endswith("/Append"))
        settled = settled and appends >= names.count(("keel-runner", "keel.commit")) + 1
        if attempts >= finished_attempts and finishes >= finished_attempts and settled:
            return roots, trace
        return None

    try:
        return await eventually(complete, "the turn's spans at the collector", 30)
    except AssertionError:
        roots = input_post_spans(collector, session)
        got = collector.trace(roots[0].trace_id) if roots else []
        raise AssertionError(
            f"the trace of the first of {len(roots)} POSTs holds only "
            f"{sorted({(s.service, s.name) for s in got})}"
        ) from None


async def test_one_turn_is_one_trace_across_every_service(traced: TracedKeel) -> None:
    """The spans looked at are those of the attempt that committed the answer
    (its epoch): on a loaded machine this module's short lease can run out
    mid-turn, and the attempt that lost it leaves spans in the same trace."""
    async with traced.http() as http:
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        seq = await _post_input(http, session, "/tool clock {}")
        facts = await _answered(http, session, seq)
    (root,), trace = await _trace_of_turn(traced.collector, session, 1, 1)

    services = {s.service for s in trace}
    assert {"keel-edge", "keel-ledger", "keel-kernel", "keel-runner"} <= services, services
    # One root, the input's POST; every other span's parent is in the trace.
    ids = {s.span_id for s in trace}
    assert [s for s in trace if not s.parent_span_id] == [root]
    orphans = [
        (s.service, s.name) for s in trace if s.parent_span_id and s.parent_span_id not in ids
    ]
    assert orphans == [], orphans
    # The answering attempt hangs under the POST, which stored its context.
    answer = next(
        f for f in facts if f["kind"] == "assistant" and seq in f["data"].get("inputSeqs", [])
    )
    epoch = answer["epoch"]
    attempts = [s for s in trace if s.name == "keel.attempt"]
    (attempt,) = [s for s in attempts if s.attributes["keel.epoch"] == epoch]
    assert all(a.parent_span_id == root.span_id for a in attempts)
    ours = [s for s in trace if s is attempt or _under(trace, s, attempt)]
    names = {s.name for s in ours if s.service == "keel-runner"}
    assert set(TURN_SPANS) <= names, names
    # The ledger's and kernel's server spans of the attempt's calls are its descendants.
    assert any(s.service == "keel-ledger" and _under(trace, s, attempt) for s in trace)
    assert any(s.service == "keel-kernel" and _under(trace, s, attempt) for s in trace)
    # The provider call: two of them (the tool call, then the answer), with model and tokens.
    providers = [s for s in ours if s.name == "keel.provider"]
    assert len(providers) == 2
    for provider in providers:
        assert provider.attributes["gen_ai.request.model"]
        assert provider.attributes["gen_ai.usage.output_tokens"] > 0
    (tool,) = [s for s in ours if s.name == "keel.tool"]
    assert tool.attributes["keel.tool.name"] == "clock"
    # Every span of the attempt names its session, tenant, epoch and attempt.
    for span in ours:
        if span.service == "keel-runner" and span.name.startswith("keel."):
            tenant = span.attributes["keel.tenant_id"]
            # Internally a session is named within its tenant.
            assert span.attributes["keel.session_id"] == f"{tenant}:{session}", span
            assert span.attributes["keel.epoch"] == epoch, span
            assert span.attributes["keel.attempt_id"] == attempt.attributes["keel.attempt_id"]
    # The context is kept with the input, not in what clients are shown.
    (shown,) = [f for f in facts if f["kind"] == "input"]
    assert set(shown["data"]) == {"text", "requestId"}, shown


async def test_a_turn_answered_after_a_runner_sigkill_stays_in_the_inputs_trace(
    traced: TracedKeel,
) -> None:
    up, collector = traced.up, traced.collector
    traced.trigger.write_text("mid_stream")
    async with traced.http() as http:
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        first = await _post_input(http, session, "/slow 1 interrupted answer")
        await up.child.line(lambda line: "FAULT mid_stream" in line, 60)
        killed = child_pid(up, "runner-1")
        # Arrives while the runner is frozen: its successor answers both inputs.
        second = await _post_input(http, session, "and one more")

        async def exported_before_the_kill() -> bool | None:
            spans = collector.spans()
            return True if any(s.pid == killed and s.name == "keel.claim" for s in spans) else None

        # The frozen runner's exporter thread still runs: what it ended is sent.
        await eventually(exported_before_the_kill, "the frozen runner's ended spans", 30)
        os.kill(killed, signal.SIGKILL)
        facts = await _answered(http, session, first)
    answer = next(f for f in facts if f["kind"] == "assistant" and first in f["data"]["inputSeqs"])
    assert second in answer["data"]["inputSeqs"]
    (first_post, second_post), trace = await _trace_of_turn(collector, session, 2, 1)
    if first_post.trace_id != trace[0].trace_id:
        first_post, second_post = second_post, first_post

    # The successor, a new process, continued the first input's trace.
    (successor,) = [s for s in trace if s.name == "keel.attempt"]
    assert successor.pid != killed
    assert successor.parent_span_id == first_post.span_id
    assert successor.links == ((second_post.trace_id, second_post.span_id),)
    successor_spans = {s.name for s in trace if s.pid == successor.pid}
    assert {"keel.provider", "keel.finish"} <= successor_spans, successor_spans
    # The killed attempt is in the same trace: its spans that ended before
    # the kill hang under its attempt span, which never ended.
    dead = [s for s in trace if s.pid == killed]
    assert {s.name for s in dead} >= {"keel.claim", "keel.epoch_started"}, dead
    (dead_epoch,) = {s.attributes["keel.epoch"] for s in dead if "keel.epoch" in s.attributes}
    assert dead_epoch < successor.attributes["keel.epoch"]
    ids = {s.span_id for s in trace}
    orphans = {s.parent_span_id for s in trace if s.parent_span_id not in ids | {""}}
    assert len(orphans) == 1, orphans
    assert all(s.pid == killed for s in trace if s.parent_span_id in orphans)


async def test_an_input_sent_over_grpc_continues_the_callers_w3c_trace(
    traced: TracedKeel,
) -> None:
    """The caller's traceparent (W3C, in the call's metadata) is the turn's
    parent: the edge's SendInput span and the answering attempt are in its trace."""
    address = json.loads(traced.up.discovery_file.read_text())["grpc"]
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    metadata = (
        ("authorization", f"Bearer {KEY}"),
        ("traceparent", f"00-{trace_id}-{caller_span}-01"),
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        created = await stub.CreateSession(pb.CreateSessionRequest(), metadata=metadata[:1])
        session = created.session_id
        sent = await stub.SendInput(
            pb.SendInputRequest(session_id=session, text="over grpc"), metadata=metadata
        )
    async with traced.http() as http:
        await _answered(http, session, sent.seq)

    def sent_by_edge(span: ReceivedSpan) -> bool:
        return span.service == "keel-edge" and span.name.endswith("SendInput")

    async def attempt_in_trace() -> list[ReceivedSpan] | None:
        # Each span is exported on its exporter's schedule: wait for both.
        trace = traced.collector.trace(trace_id)
        attempted = any(s.name == "keel.attempt" for s in trace)
        return trace if attempted and any(sent_by_edge(s) for s in trace) else None

    trace = await eventually(attempt_in_trace, "the attempt in the caller's trace", 30)
    (send_input,) = [s for s in trace if sent_by_edge(s)]
    assert send_input.parent_span_id == caller_span
    (attempt,) = [s for s in trace if s.name == "keel.attempt"]
    assert attempt.parent_span_id == send_input.span_id


async def test_a_compaction_is_in_the_trace_of_the_turn_it_runs_in(traced: TracedKeel) -> None:
    """A small context window makes a compaction due within a few turns: it
    runs inside the turn's attempt, so the compaction service's spans (a
    runner's own, under `keel up --processes`) and the ledger's append of the
    summary hang under the runner's compaction span, in the input's trace.

    The span looked for is the one of the attempt that committed the
    compaction (its epoch), not the first compaction span of the session: on
    a loaded machine the short lease of this module can run out mid-turn,
    and the attempt that lost it began a compaction whose call never
    appended anything, in the same input's trace as its successor's."""
    loadout = {
        "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": 2400},
        "compaction": {"enabled": True, "keepRecentTokens": 700, "reserveTokens": 600},
    }
    async with traced.http() as http:
        put = await http.put("/v1/loadout", json=loadout)
        assert put.status_code == 200, put.text
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        for _ in range(16):
            facts = await _answered(http, session, await _post_input(http, session, "/long 300"))
            if any(f["kind"] == "compaction" for f in facts):
                break
        else:
            raise AssertionError("the history never made a compaction due")
    epoch = next(f["epoch"] for f in facts if f["kind"] == "compaction")

    def compact_span(trace: list[ReceivedSpan], parent: ReceivedSpan) -> ReceivedSpan | None:
        calls = [s for s in trace if s.name.endswith("/Compact")]
        return next((s for s in calls if s.parent_span_id == parent.span_id), None)

    def appended_by(span: ReceivedSpan) -> list[ReceivedSpan] | None:
        """The trace of `span` once it holds the runner's call, the service's
        server span under it, and the ledger's append of the compaction fact
        under that."""
        trace = traced.collector.trace(span.trace_id)
        call = compact_span(trace, span)
        served = None if call is None else compact_span(trace, call)
        if served is None:
            return None
        appended = [s for s in trace if s.service == "keel-ledger" and _under(trace, s, served)]
        return trace if appended else None

    async def compaction_trace() -> tuple[ReceivedSpan, ReceivedSpan] | None:
        for span in traced.collector.spans():
            if (
                span.name == "keel.compaction"
                and span.attributes["keel.session_id"].endswith(session)
                and span.attributes["keel.epoch"] == epoch
            ):
                trace = appended_by(span)
                # Spans reach the collector in batches, each process's on its
                # own timer: the attempt's span (which ends after the turn)
                # may come after the compaction's. Done once the chain up to
                # the trace's root is all there.
                roots = [s for s in trace or () if not s.parent_span_id]
                if trace is not None and len(roots) == 1 and _under(trace, span, roots[0]):
                    return span, roots[0]
        return None

    _, root = await eventually(
        compaction_trace, "the compaction's spans, up to the input's, at the collector", 30
    )
    assert root.service == "keel-edge"


def _under(trace: list[ReceivedSpan], span: ReceivedSpan, ancestor: ReceivedSpan) -> bool:
    by_id = {s.span_id: s for s in trace}
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        if span is ancestor:
            return True
    return False
