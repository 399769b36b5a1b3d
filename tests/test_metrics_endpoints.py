"""Every process of `keel up --processes` serves its own Prometheus metrics,
and a runner SIGKILLed mid-answer shows as a reclaimed lease and a takeover.

The supervisor gives each child a metrics port and lists them once Keel is
up. A runner frozen at a fault point mid-answer is SIGKILLed; its successor
(the restarted runner) reclaims the session: the kernel's `reclaimed`
counter and takeover histogram move, and the successor times its first
commit. Then a tool call, enough turns for a compaction, an SSE client, a
context rebuild and a drain make every instrument the dashboard reads show
on the endpoint of the process that records it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.keel_up import RunningKeel, child_pid, keel_up, restarted_child
from tests.support.metrics import dashboard_metrics, scrape, total
from tests.support.polling import eventually

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow

KEY = "metrics-test-key-0123456789abcdef"
LEASE_MS = 2000
SERVICES = ("ledger", "kernel", "compaction", "runner-1", "edge")
# What each process's endpoint must serve once the scenario ran (sample names).
EXPECTED = {
    "ledger": {
        "keel_ledger_append_latency_milliseconds_bucket",
        "keel_ledger_batch_size_bucket",
        "keel_ledger_facts_appended_total",
        # 0 from the start: no writer was fenced off.
        "keel_ledger_stale_appends_total",
    },
    "kernel": {
        "keel_kernel_claims_total",
        "keel_kernel_reclaimed_total",
        "keel_kernel_takeover_latency_milliseconds_bucket",
        "keel_kernel_finishes_total",
        "keel_kernel_expirations_total",
        "keel_kernel_queue_depth",
        "keel_kernel_queue_wait_milliseconds_bucket",
        "keel_kernel_admission_rejections_total",
        "keel_kernel_lease_age_milliseconds_bucket",
    },
    "compaction": {
        "keel_compaction_compactions_total",
        "keel_compaction_context_latency_milliseconds_bucket",
    },
    "runner-1": {
        "keel_runner_turns_total",
        "keel_runner_attempts_total",
        "keel_runner_takeover_first_commit_milliseconds_bucket",
        "keel_runner_provider_latency_milliseconds_bucket",
        "keel_runner_provider_first_event_milliseconds_bucket",
        "keel_runner_provider_tokens_total",
        "keel_runner_tool_latency_milliseconds_bucket",
        "keel_runner_claim_failures_total",
        # Served at zero before the runner's first drain.
        "keel_runner_drain_duration_milliseconds_bucket",
        # The runner's own compaction service commits its compactions.
        "keel_compaction_compactions_total",
        "keel_compaction_duration_milliseconds_bucket",
    },
    "edge": {
        "keel_edge_requests_total",
        "keel_edge_sse_clients",
        "keel_edge_sse_frames_total",
        "keel_edge_drain_duration_milliseconds_bucket",
    },
}
_LISTED = re.compile(r"^\s+(\S+): (http://127\.0\.0\.1:\d+/metrics)$")


def metrics_urls(up: RunningKeel) -> dict[str, str]:
    """The metrics URL of each child, as `keel up` listed them."""
    lines = list(up.child.lines)
    start = lines.index("metrics (Prometheus text, one port per process):")
    urls: dict[str, str] = {}
    for line in lines[start + 1 :]:
        found = _LISTED.match(line)
        if found is None:
            break
        urls[found.group(1)] = found.group(2)
    return urls


def api(up: RunningKeel) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=up.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )


async def answered(http: httpx.AsyncClient, session: str, seq: int) -> None:
    async def facts() -> bool | None:
        page = (await http.get(f"/v1/sessions/{session}/events?format=json")).json()
        found: list[dict[str, Any]] = page["facts"]
        done = any(
            f["kind"] == "assistant" and seq in f["data"].get("inputSeqs", []) for f in found
        )
        return True if done else None

    await eventually(facts, f"an answer to input {seq}", 30)


async def post_input(http: httpx.AsyncClient, session: str, text: str) -> int:
    posted = await http.post(f"/v1/sessions/{session}/inputs", json={"text": text})
    assert posted.status_code == 202, posted.text
    seq: int = posted.json()["seq"]
    return seq


@contextlib.asynccontextmanager
async def sse_client(up: RunningKeel, session: str) -> AsyncIterator[asyncio.Event]:
    """An SSE client of `session`, open until the block ends; the event is
    set once it received its first event."""
    received = asyncio.Event()

    async def follow() -> None:
        async with api(up) as http, http.stream("GET", f"/v1/sessions/{session}/events") as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    received.set()

    task = asyncio.create_task(follow())
    try:
        yield received
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task


async def take_over(up: RunningKeel, http: httpx.AsyncClient, trigger: Path) -> None:
    """A runner frozen mid-answer is SIGKILLed; its restarted successor
    reclaims the session and answers."""
    session = (await http.post("/v1/sessions", json={})).json()["id"]
    # Armed: the first runner to reach the point freezes there.
    await asyncio.to_thread(trigger.write_text, "mid_stream")
    seq = await post_input(http, session, "answer me, whoever survives")
    await up.child.line(lambda line: line.endswith("FAULT mid_stream"), 30)
    pid = child_pid(up, "runner-1")
    os.kill(pid, signal.SIGKILL)
    await restarted_child(up, "runner-1", pid, 30)
    await answered(http, session, seq)


async def run_everything_once(up: RunningKeel, http: httpx.AsyncClient) -> str:
    """A tool call, a compaction, a context rebuild; returns the session."""
    session: str = (await http.post("/v1/sessions", json={})).json()["id"]
    await answered(http, session, await post_input(http, session, "/tool clock {}"))

    async def compacted() -> bool | None:
        await answered(http, session, await post_input(http, session, "/long 300"))
        page = (await http.get(f"/v1/sessions/{session}/events?format=json")).json()
        return True if any(f["kind"] == "compaction" for f in page["facts"]) else None

    await eventually(compacted, "a compaction of a long session", 30)
    context = await http.get(f"/v1/sessions/{session}/context")
    assert context.status_code == 200, context.text
    return session


async def test_every_process_serves_its_metrics_and_a_takeover_moves_them(
    tmp_path: Path,
) -> None:
    trigger = tmp_path / "fault-trigger"
    env = {"KEEL_LEASE_MS": str(LEASE_MS), "KEEL_FAULT_TRIGGER": str(trigger)}
    with keel_up(tmp_path / "keel", KEY, "--processes", env=env) as up:
        urls = metrics_urls(up)
        assert set(urls) == set(SERVICES), urls
        # Distinct ports, one per process, on loopback (as listed: _LISTED).
        assert len(set(urls.values())) == len(urls)
        before = await scrape(urls["kernel"])
        async with api(up) as http:
            # A small window: a few long answers make a compaction due.
            put = await http.put(
                "/v1/loadout",
                json={
                    "model": {"provider": "scripted", "name": "scripted-1", "contextWindow": 2400},
                    "compaction": {"enabled": True, "keepRecentTokens": 700, "reserveTokens": 600},
                },
            )
            assert put.status_code == 200, put.text
            await take_over(up, http, trigger)
            after = await scrape(urls["kernel"])
            # The takeover moved the reclaimed counter and the takeover histogram.
            # At least once: with a 2 s lease, a machine slow enough to let the
            # frozen runner's lease (or its successor's, while it starts) run
            # out adds a takeover of its own, which is right, not a fault.
            reclaimed = "keel_kernel_reclaimed_total"
            assert total(after, reclaimed) >= total(before, reclaimed) + 1, after.get(reclaimed)
            assert {labels["expired_by"] for labels, _ in after[reclaimed]} <= {"ttl", "disconnect"}
            takeovers = "keel_kernel_takeover_latency_milliseconds_count"
            assert total(after, takeovers) >= total(before, takeovers) + 1
            successor = await scrape(urls["runner-1"])
            assert total(successor, "keel_runner_takeover_first_commit_milliseconds_count") >= 1

            session = await run_everything_once(up, http)
            # Read before the drain: a drained runner exits (and is replaced).
            runner = await scrape(urls["runner-1"])
            async with sse_client(up, session) as streaming:
                await asyncio.wait_for(streaming.wait(), 30)
                edge = await scrape(urls["edge"])
                assert total(edge, "keel_edge_sse_clients") == 1
                assert total(edge, "keel_edge_sse_frames_total") >= 1
            drained = await http.post(
                "/v1/runtime/drain", json={"mode": "handoff", "deadlineMs": 2000}
            )
            assert drained.status_code == 202, drained.text
        scraped = {name: await scrape(url) for name, url in urls.items() if name != "runner-1"}
        scraped["runner-1"] = runner
        missing = {name: EXPECTED[name] - set(scraped[name]) for name in EXPECTED}
        assert all(not names for names in missing.values()), missing
        # Every series the dashboard queries is one some process serves.
        served = {sample for samples in scraped.values() for sample in samples}
        # Nothing served names a tenant, a session or a key: whoever reaches a
        # metrics port learns load, not who the tenants are.
        labels = {
            name
            for samples in scraped.values()
            for series in samples.values()
            for found, _ in series
            for name in found
        }
        assert not {k for k in labels if "tenant" in k or "session" in k or "key" in k}, labels
        assert dashboard_metrics() - served == set()
        assert total(scraped["edge"], "keel_edge_drain_duration_milliseconds_count") == 1
