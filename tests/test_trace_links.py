"""Traces of inputs answered together, and span names that stay few.

`keel up --processes` exports every process's spans to a real OTLP
collector (tests/support/otlp_collector.py). The runner stops itself
(SIGSTOP, `KEEL_FAULT_ACTION=stop`) in the middle of answering a first input;
two more inputs are posted meanwhile, then it is resumed: the next attempt
answers both with one answer (as in tests/runner/test_batch_inputs.py).

- The edge's HTTP spans are named after the route's template, never the
  path with its session id.
- The edge's POST span, its Enqueue call and the kernel's Enqueue span name
  the session (`keel.session_id`).
- The answer's span links to both inputs' traces, and the trace of the input
  whose trace the attempt did not continue reaches the runner too.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.keel_up import RunningKeel, child_pid, keel_up
from tests.support.otlp_collector import OtlpCollector, ReceivedSpan, input_post_spans
from tests.support.polling import eventually

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow

KEY = "trace-links-test-key-0123456789abcdef"
INPUTS_ROUTE = "/v1/sessions/{id}/inputs"


@dataclass(frozen=True)
class Traced:
    up: RunningKeel
    collector: OtlpCollector
    # Written, it stops the first runner that reaches the point it names.
    trigger: Path


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    collector = OtlpCollector().start()
    data = tmp_path_factory.mktemp("trace-links")
    trigger = data / "fault-trigger"
    env = {**collector.env(), "KEEL_FAULT_TRIGGER": str(trigger), "KEEL_FAULT_ACTION": "stop"}
    try:
        with keel_up(data / "keel", KEY, "--processes", env=env) as up:
            yield Traced(up, collector, trigger)
    finally:
        collector.stop()


def _http(up: RunningKeel) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=up.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )


async def _post_input(http: httpx.AsyncClient, session: str, text: str) -> int:
    posted = await http.post(f"/v1/sessions/{session}/inputs", json={"text": text})
    assert posted.status_code == 202, posted.text
    seq: int = posted.json()["seq"]
    return seq


async def _answer_of(http: httpx.AsyncClient, session: str, seq: int) -> dict[str, Any]:
    async def answer() -> dict[str, Any] | None:
        page = (await http.get(f"/v1/sessions/{session}/events?format=json")).json()
        for fact in page["facts"]:
            if fact["kind"] == "assistant" and seq in fact["data"].get("inputSeqs", []):
                found: dict[str, Any] = fact
                return found
        return None

    return await eventually(answer, f"an answer to input {seq}", 60)


def _of_session(span: ReceivedSpan, session: str) -> bool:
    # Internally a session is named within its tenant: `tenant:session`.
    return str(span.attributes.get("keel.session_id", "")).endswith(f":{session}")


async def test_an_answer_to_two_inputs_links_both_traces(traced: Traced) -> None:
    up, collector = traced.up, traced.collector
    async with _http(up) as http:
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        traced.trigger.write_text("mid_stream")
        first = await _post_input(http, session, "hello")
        await up.child.line(lambda line: "FAULT mid_stream" in line, 60)
        # The runner is stopped inside the first attempt, which answers the
        # first input only: both inputs wait for the next attempt.
        runner = child_pid(up, "runner-1")
        second = await _post_input(http, session, "and a second")
        third = await _post_input(http, session, "and a third")
        os.kill(runner, signal.SIGCONT)
        answer = await _answer_of(http, session, third)
        first_answer = await _answer_of(http, session, first)
    assert first_answer["data"]["inputSeqs"] == [first]
    assert answer["data"]["inputSeqs"] == [second, third]

    async def linked() -> tuple[ReceivedSpan, list[ReceivedSpan]] | None:
        answers = [
            s
            for s in collector.spans()
            if s.name == "keel.answer"
            and _of_session(s, session)
            and len(s.links) == 2
            and s.attributes["keel.epoch"] == answer["epoch"]
        ]
        roots = input_post_spans(collector, session)
        return (answers[0], roots) if answers and len(roots) == 3 else None

    answer_span, roots = await eventually(linked, "the answer's span at the collector", 30)

    # Span names: the route's template, bounded whatever the session id.
    assert {s.name for s in roots} == {f"POST {INPUTS_ROUTE}"}
    assert all(s.attributes["http.route"] == INPUTS_ROUTE for s in roots)
    assert not [s.name for s in collector.spans() if session in s.name]

    # The answer links to the trace of each input it answered (the POST
    # spans whose context each input carried), not to the first input's.
    assert len({s.trace_id for s in roots}) == 3
    answered = set(answer_span.links)
    assert len(answered) == 2 and answered <= {(s.trace_id, s.span_id) for s in roots}
    (first_post,) = [s for s in roots if (s.trace_id, s.span_id) not in answered]
    first_answers = [s for s in collector.trace(first_post.trace_id) if s.name == "keel.answer"]
    assert [s.links for s in first_answers] == [((first_post.trace_id, first_post.span_id),)]
    # It continues one of the two; the other's trace gets a span linking back.
    (own,) = [link for link in answered if link[0] == answer_span.trace_id]
    (other,) = answered - {own}

    async def answered_in_other_trace() -> ReceivedSpan | None:
        found = [s for s in collector.trace(other[0]) if s.name == "keel.answered"]
        return found[0] if found else None

    marker = await eventually(answered_in_other_trace, "keel.answered in the other trace", 30)
    assert marker.parent_span_id == other[1]
    assert marker.links == ((answer_span.trace_id, answer_span.span_id),)
    assert marker.service == "keel-runner"

    # Each POST, its Enqueue call and the kernel's Enqueue name the session.
    async def enqueues() -> list[tuple[ReceivedSpan, ReceivedSpan]] | None:
        pairs = []
        for root in roots:
            trace = collector.trace(root.trace_id)
            calls = [
                s
                for s in trace
                if s.service == "keel-edge"
                and s.name.endswith("KernelService/Enqueue")
                and s.parent_span_id == root.span_id
            ]
            served = [
                s
                for s in trace
                if s.service == "keel-kernel"
                and s.name.endswith("KernelService/Enqueue")
                and calls
                and s.parent_span_id == calls[0].span_id
            ]
            if not (calls and served):
                return None
            pairs.append((calls[0], served[0]))
        return pairs

    for call, served in await eventually(enqueues, "the Enqueue spans of the inputs", 30):
        assert _of_session(call, session), call
        assert _of_session(served, session), served
    assert all(_of_session(root, session) for root in roots)
