"""`keel drain --local` and drains under `keel up --processes`, as operators run them.

- `keel drain --local --mode handoff --deadline-ms 5000 --data-dir D` (the
  manifests' preStop) drains the runner and the edge that recorded
  themselves under D, directly: the runner busy with a slow answer stops at
  the deadline and gives the session back, a successor (epoch+1) completes
  the answer exactly once, the edge tells its SSE client `drain`, and both
  drained processes exit 0 and are replaced by the supervisor.
- `keel drain` with no id drains the runners, never the edge: its streams go
  on, /readyz stays 200, and the supervisor's new runner answers.
- With nothing recorded, or only records of dead processes, it says so and
  exits 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from services.cli.chat_view import SseEvent, SseParser
from services.common.runtime_records import local_runtimes, record_runtime
from tests.processes import ChildProcess
from tests.runner.cluster import eventually
from tests.support.keel_up import KEEL, clean_env, keel_cli

KEY = "local-drain-dev-key-0123456789"
DEADLINE_S = 60.0


@asynccontextmanager
async def keel_up_processes(data_dir: Path) -> AsyncIterator[tuple[ChildProcess, str]]:
    """`keel up --processes` with one runner; (its process, the edge's URL)."""
    ports = ("--http-port", "0", "--grpc-port", "0")
    child = ChildProcess(
        [str(KEEL), "up", "--processes", "--data-dir", str(data_dir), *ports],
        env=clean_env(KEEL_DEV_KEY=KEY),
    )
    try:
        line = await child.line(lambda text: text.startswith("Keel is up: http://"), DEADLINE_S)
        yield child, line.split()[3].split("/#")[0]
    finally:
        await asyncio.to_thread(child.terminate, 30)


def client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=DEADLINE_S
    )


async def facts_of(url: str, session: str) -> list[dict[str, Any]] | None:
    """The session's facts, or None while the edge is not serving (restarting)."""
    try:
        async with client(url) as http:
            page = await http.get(f"/v1/sessions/{session}/events?format=json&limit=1000")
    except httpx.TransportError:
        return None
    if page.status_code != 200:
        return None
    facts: list[dict[str, Any]] = page.json()["facts"]
    return facts


def answered(facts: list[dict[str, Any]], seq: int) -> bool:
    return any(f["kind"] == "assistant" and seq in f["data"].get("inputSeqs", []) for f in facts)


async def read_stream(
    url: str, session: str, after: int, into: list[SseEvent], done: Callable[[], bool]
) -> bool:
    """One SSE connection from `after` to its end, or until `done`; True
    when it ended with `drain`."""
    headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after)}
    parser = SseParser()
    async with (
        client(url) as http,
        http.stream("GET", f"/v1/sessions/{session}/events", headers=headers) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            event = parser.feed(line)
            if event is None:
                continue
            into.append(event)
            if event.event == "drain":
                return True
            if done():
                break
    return False


async def follow(url: str, session: str, into: list[SseEvent], done: Callable[[], bool]) -> int:
    """Follows the stream across the edge's restarts until `done`, as a
    browser would (after `drain`, reconnecting when told); how many times
    the edge said `drain`."""
    drains = 0
    while not done():
        seqs = [int(e.id) for e in into if e.id is not None]
        try:
            drained = await read_stream(url, session, seqs[-1] if seqs else 0, into, done)
        except (httpx.TransportError, AssertionError):
            await asyncio.sleep(0.1)  # the edge is restarting: try again
            continue
        if drained:
            drains += 1
            await asyncio.sleep(json.loads(into[-1].data)["retry_after_ms"] / 1000)
    return drains


def exited(name: str, pid: int) -> Callable[[str], bool]:
    """The supervisor's line for a child that exited 0 and is started again."""
    return lambda text: f"{name} (pid {pid}) exited with 0; restarting" in text


async def start_slow_answer(url: str, text: str) -> tuple[str, int]:
    async with client(url) as http:
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        posted = await http.post(
            f"/v1/sessions/{session}/inputs", json={"text": text, "requestId": "slow-1"}
        )
        assert posted.status_code == 202, posted.text
    seq: int = posted.json()["seq"]

    async def started() -> bool | None:
        facts = await facts_of(url, session)
        return True if facts and any(f["kind"] == "epoch_started" for f in facts) else None

    await eventually(started, "the runner to start answering", DEADLINE_S)
    return session, seq


async def test_a_local_handoff_drain_hands_the_answer_to_a_successor(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    async with keel_up_processes(data_dir) as (up, url):
        records = {r.role: r for r in local_runtimes(data_dir)}
        assert set(records) == {"runner", "edge"}, records
        # Streams for 16 s: still running when the 5 s deadline passes (the
        # drain command starts within seconds, even on a loaded machine).
        session, seq = await start_slow_answer(url, "/slow 16 " + " ".join(["word"] * 16))
        events: list[SseEvent] = []

        def complete() -> bool:
            return any(
                e.event == "assistant" and seq in json.loads(e.data)["data"].get("inputSeqs", [])
                for e in events
            )

        following = asyncio.create_task(follow(url, session, events, complete))

        async def stream_open() -> bool | None:
            return True if events else None

        await eventually(stream_open, "the stream to open", DEADLINE_S)
        drain = ["drain", "--local", "--mode", "handoff", "--deadline-ms", "5000"]
        drained = await keel_cli(*drain, "--data-dir", str(data_dir))
        assert drained.returncode == 0, drained.stderr
        lines = drained.stdout.splitlines()
        runner, edge = records["runner"], records["edge"]
        # Stopped at the deadline where it was, and given back at once.
        assert (
            f"runner {runner.runtime_id} (pid {runner.pid}): drained (handoff): "
            "1 run(s) in flight, 1 stopped where they were"
        ) in lines, lines
        assert any(
            line.startswith(f"edge {edge.runtime_id} (pid {edge.pid}): drained") for line in lines
        )
        await up.line(exited("runner-1", runner.pid), DEADLINE_S)
        await up.line(exited("edge", edge.pid), DEADLINE_S)

        drains = await asyncio.wait_for(following, DEADLINE_S)
        assert drains >= 1, "the draining edge told its client `drain`"
        facts = await eventually(lambda: facts_of(url, session), "the edge back", DEADLINE_S)
    seqs = [f["seq"] for f in facts]
    assert seqs == list(range(1, len(seqs) + 1))
    assert [int(e.id) for e in events if e.id is not None] == seqs, "the client saw each fact once"
    starts = [f for f in facts if f["kind"] == "epoch_started"]
    finals = [f for f in facts if f["kind"] == "assistant"]
    assert len(starts) == 2 and starts[1]["data"]["epoch"] == starts[0]["data"]["epoch"] + 1
    assert starts[0]["data"]["runtimeId"] == runner.runtime_id != starts[1]["data"]["runtimeId"]
    assert len(finals) == 1 and finals[0]["epoch"] == starts[1]["data"]["epoch"], (
        "once, by the successor"
    )


async def test_a_drain_without_an_id_replaces_the_runner_and_leaves_the_edge_serving(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    async with keel_up_processes(data_dir) as (up, url):
        [runner] = [r for r in local_runtimes(data_dir) if r.role == "runner"]
        async with client(url) as http:
            session = (await http.post("/v1/sessions", json={})).json()["id"]
            events: list[SseEvent] = []
            stream = asyncio.create_task(read_stream(url, session, 0, events, lambda: False))
            where = {"KEEL_DATA_DIR": str(data_dir), "KEEL_API_KEY": KEY}
            drained = await keel_cli("drain", env=where)
            assert drained.returncode == 0, drained.stderr
            assert drained.stdout.startswith(f"{runner.runtime_id}: drained (handoff)")
            await up.line(exited("runner-1", runner.pid), DEADLINE_S)
            assert (await http.get("/readyz")).status_code == 200
            posted = await http.post(
                f"/v1/sessions/{session}/inputs", json={"text": "hello", "requestId": "h-1"}
            )
            seq = posted.json()["seq"]
            facts = await eventually(
                lambda: _answered_facts(url, session, seq), "the new runner to answer", DEADLINE_S
            )
            assert not stream.done(), "the edge's stream was not drained"
            stream.cancel()
    assert all(e.event != "drain" for e in events)
    [start] = [f for f in facts if f["kind"] == "epoch_started"]
    assert start["data"]["runtimeId"] != runner.runtime_id


async def _answered_facts(url: str, session: str, seq: int) -> list[dict[str, Any]] | None:
    facts = await facts_of(url, session)
    return facts if facts is not None and answered(facts, seq) else None


def test_nothing_recorded_or_only_the_dead_is_an_error(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = clean_env(KEEL_INTERNAL_TOKEN="local-drain-test-token-0123456789")

    def drain() -> subprocess.CompletedProcess[str]:
        command = [str(KEEL), "drain", "--local", "--data-dir", str(data_dir)]
        return subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=DEADLINE_S, check=False
        )

    nothing = drain()
    assert nothing.returncode == 1 and "Traceback" not in nothing.stderr
    assert nothing.stderr.startswith("keel drain --local: no runtime recorded under")

    # A record left by a process that is gone (as SIGKILL leaves it).
    script = [sys.executable, "-c", "import os; print(os.getpid())"]
    dead = subprocess.run(script, capture_output=True, text=True, check=True)
    path = record_runtime(data_dir, "rt-dead", "runner", "127.0.0.1:1")
    assert path is not None
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "pid": int(dead.stdout)}))
    stale = drain()
    assert stale.returncode == 1
    assert f"runner rt-dead: pid {int(dead.stdout)} is gone" in stale.stdout
    assert not path.exists(), "the dead process's record was removed"
    assert not os.listdir(data_dir / "runtimes")
