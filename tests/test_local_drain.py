"""`keel drain --local` and drains under `keel up --processes`, as operators run them.

- `keel drain --local --mode handoff --deadline-ms 5000 --data-dir D` (the
  manifests' preStop) beside `keel up --processes --grpc-base-port B`
  drains the runner that recorded itself under D, directly, and only the
  runner (as the edge's drain does): the runner busy with a slow answer
  stops at the deadline and gives the session back, a successor (epoch+1)
  completes the answer exactly once, and the drained runner exits 0 and is
  replaced by the supervisor on its port (B+3); the edge is not drained
  (its SSE client never hears `drain`, the edge is not restarted). The
  record a killed earlier run left behind is deleted without a word.
- `keel drain` with no id drains the runners, never the edge: its streams go
  on, /readyz stays 200, and the supervisor's new runner answers.
- With nothing recorded, or only records of dead processes, it says so and
  exits 1 (the dead records deleted, not listed one by one).
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
import pytest

from services.cli.chat_view import SseEvent, SseParser
from services.common.runtime_records import local_runtimes, records_dir
from tests.support.keel_up import KEEL, clean_env, free_port_run, keel_cli
from tests.support.polling import eventually
from tests.support.processes import ChildProcess

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow

KEY = "local-drain-dev-key-0123456789"
DEADLINE_S = 60.0


@asynccontextmanager
async def keel_up_processes(data_dir: Path, *args: str) -> AsyncIterator[tuple[ChildProcess, str]]:
    """`keel up --processes ARGS` with one runner; (its process, the edge's URL)."""
    ports = ("--http-port", "0", "--grpc-port", "0")
    child = ChildProcess(
        [str(KEEL), "up", "--processes", "--data-dir", str(data_dir), *ports, *args],
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


def dead_pid() -> int:
    """The pid of a process that has exited (as a SIGKILLed one leaves its record)."""
    script = [sys.executable, "-c", "import os; print(os.getpid())"]
    return int(subprocess.run(script, capture_output=True, text=True, check=True).stdout)


def plant_dead_record(data_dir: Path, runtime_id: str, role: str = "runner") -> Path:
    """A record as a runtime writes it, of a process that is gone."""
    folder = records_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{runtime_id}.json"
    record = {"runtimeId": runtime_id, "role": role, "pid": dead_pid(), "address": "127.0.0.1:1"}
    path.write_text(json.dumps({**record, "startedAtMs": 1}))
    return path


async def test_a_local_handoff_drain_beside_keel_up_drains_only_the_runner(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    base = free_port_run(4)  # ledger, kernel, compaction, runner-1
    async with keel_up_processes(data_dir, "--grpc-base-port", str(base)) as (up, url):
        records = {r.role: r for r in local_runtimes(data_dir)}
        assert set(records) == {"runner", "edge"}, records
        runner, edge = records["runner"], records["edge"]
        assert runner.address == f"127.0.0.1:{base + 3}"
        assert any(line.endswith(f"kernel listening on 127.0.0.1:{base + 1}") for line in up.lines)
        # What an earlier, killed run left behind: deleted, never reported.
        dead = plant_dead_record(data_dir, "rt-killed-earlier")
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
        # Stopped at the deadline where it was, and given back at once; the
        # edge is left alone and the dead record is not mentioned.
        assert drained.stdout.splitlines() == [
            f"runner {runner.runtime_id} (pid {runner.pid}): drained (handoff): "
            "1 run(s) in flight, 1 stopped where they were"
        ], drained.stdout
        assert not dead.exists()
        await up.line(exited("runner-1", runner.pid), DEADLINE_S)
        successor = await up.line(
            lambda text: text.startswith("[runner-1 ") and "listening on" in text, DEADLINE_S
        )
        assert successor.endswith(f"listening on 127.0.0.1:{base + 3}"), successor

        drains = await asyncio.wait_for(following, DEADLINE_S)
        assert drains == 0, "the edge was not drained: its client never heard `drain`"
        assert not any(f"edge (pid {edge.pid}) exited" in line for line in up.lines)
        assert [r.runtime_id for r in local_runtimes(data_dir) if r.role == "edge"] == [
            edge.runtime_id
        ]
        facts = await eventually(lambda: facts_of(url, session), "the facts", DEADLINE_S)
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

    # Records left by processes that are gone (as SIGKILL leaves them).
    paths = [plant_dead_record(data_dir, f"rt-dead-{i}") for i in range(3)]
    stale = drain()
    assert stale.returncode == 1
    assert stale.stdout == "", "a gone process is not reported one by one"
    assert stale.stderr.startswith("keel drain --local: no runtime recorded under")
    assert not any(path.exists() for path in paths), "the dead processes' records were removed"
    assert not os.listdir(data_dir / "runtimes")
