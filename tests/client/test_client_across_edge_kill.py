"""The client library's event iterator across a SIGKILLed edge.

`keel up --processes` runs each service as its own OS process under a
supervisor that restarts a child that dies. A session answers several slow
inputs while `AsyncKeelClient.events()` follows it over gRPC; the edge
process is SIGKILLed mid-answer (no drain, no goodbye: the connection just
breaks). The supervisor starts a new edge on the same gRPC port and the
iterator, reconnecting by itself, carries on: the fact seqs it yielded are
exactly 1..head, no gap, no duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import httpx
import pytest

from keel_client import AsyncKeelClient, ClientOptions, Delta, Event, Fact, ReconnectPolicy
from tests.support.client_events import answers, fact_seqs, has_seq, read_until
from tests.support.keel_up import keel_up_processes
from tests.support.polling import eventually
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

KEY = "client-kill-test-key-0123456789"
SLOW_INPUTS = 3


async def test_the_iterator_survives_a_sigkilled_edge_without_gap_or_duplicate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="keel_client")
    http_port, grpc_port = free_port(), free_port()
    child = keel_up_processes(tmp_path / "data", KEY, http_port, grpc_port)
    options = ClientOptions(reconnect=ReconnectPolicy(max_backoff_s=0.5, give_up_after_s=90))
    try:
        edge_line = await child.line(lambda text: text.strip().startswith("edge: pid"), 90)
        edge_pid = int(edge_line.split()[-1])
        grpc_line = await child.line(lambda text: text.startswith("gRPC API:"), 60)
        address = grpc_line.split()[-1]
        assert address == f"127.0.0.1:{grpc_port}"
        await child.line(lambda text: text.startswith("Keel is up: http://"), 60)

        async with AsyncKeelClient(address, KEY, options=options) as keel:
            session = await keel.create_session()
            seen: list[Event] = []
            events = keel.events(session)
            await read_until(events, has_seq(1), seen)
            sent = [
                await keel.send_input(
                    session, f"/slow 2 answer {i} one two three four five six", f"kill-{i}"
                )
                for i in range(SLOW_INPUTS)
            ]
            last_input = sent[-1].seq
            reading = asyncio.ensure_future(read_until(events, answers(last_input), seen, 120))
            try:

                async def streaming() -> bool | None:
                    if reading.done():
                        reading.result()  # an error surfaces here, not as a timeout
                        raise AssertionError("every answer came before the edge was killed")
                    started = any(isinstance(e, Fact) and e.kind == "epoch_started" for e in seen)
                    return True if started and isinstance(seen[-1], Delta) else None

                await eventually(streaming, "the answer to stream through the edge", 60)
                yielded_before_kill = len(fact_seqs(seen))
                os.kill(edge_pid, signal.SIGKILL)
                exited = await child.line(lambda text: f"edge (pid {edge_pid}) exited" in text, 60)
                assert "exited with -9; restarting" in exited
                restarted = await child.line(
                    lambda text: text.strip().startswith("edge: pid") and str(edge_pid) not in text,
                    60,
                )
                assert int(restarted.split()[-1]) != edge_pid

                final = await reading
                assert isinstance(final, Fact)
                # Whatever was committed after the answer, up to the head, too.
                head = (await keel.get_session(session)).head_seq
                if head > final.seq:
                    await read_until(events, has_seq(head), seen)
            finally:
                reading.cancel()
                await events.aclose()

        seqs = fact_seqs(seen)
        assert len(seqs) > yielded_before_kill, "facts came through the restarted edge"
        # The stream broke (no drain: the edge had no chance to send one).
        lost = [r.getMessage() for r in caplog.records if "event stream lost" in r.getMessage()]
        assert lost, "the iterator reconnected after a broken stream"
        assert not any("draining" in r.getMessage() for r in caplog.records)
        assert seqs == list(range(1, head + 1)), "no gap, no duplicate"
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{http_port}",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        ) as http:
            page = (await http.get(f"/v1/sessions/{session}/events?format=json")).json()
        committed = [(f["seq"], f["kind"]) for f in page["facts"]]
        assert [(f.seq, f.kind) for f in seen if isinstance(f, Fact)] == committed[:head]
        answered = {
            seq
            for f in seen
            if isinstance(f, Fact) and f.kind == "assistant"
            for seq in f.data.get("inputSeqs", ())
        }
        assert {s.seq for s in sent} <= answered
    finally:
        await asyncio.to_thread(child.terminate, 30)
