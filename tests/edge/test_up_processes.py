"""`keel up --processes`: each service its own OS process under a supervisor
that restarts a child that dies. A runner is SIGKILLed mid-answer; the
supervisor starts a new one, which takes the session over and finishes."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.support.keel_up import keel_up_processes
from tests.support.polling import eventually
from tests.support.ports import free_port

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow

KEY = "processes-test-key-0123456789"


async def test_the_supervisor_restarts_a_killed_runner_and_the_session_goes_on(
    tmp_path: Path,
) -> None:
    port = free_port()
    child = keel_up_processes(tmp_path / "data", KEY, port, 0)
    try:
        runner_line = await child.line(lambda text: text.strip().startswith("runner-1: pid"), 60)
        runner_pid = int(runner_line.split()[-1])
        await child.line(lambda text: text.startswith("Keel is up: http://"), 60)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        ) as http:
            session = (await http.post("/v1/sessions", json={})).json()["id"]
            posted = await http.post(
                f"/v1/sessions/{session}/inputs",
                json={"text": "/slow 3 one two three four five six", "requestId": "p-1"},
            )
            assert posted.status_code == 202
            seq = posted.json()["seq"]

            async def started() -> bool | None:
                page = (await http.get(f"/v1/sessions/{session}/events?format=json")).json()
                kinds = [f["kind"] for f in page["facts"]]
                return True if "epoch_started" in kinds else None

            await eventually(started, "the runner to start answering")
            os.kill(runner_pid, signal.SIGKILL)
            await child.line(lambda text: "runner-1" in text and "restarting" in text, 60)

            async def answered() -> list[dict[str, object]] | None:
                page = (await http.get(f"/v1/sessions/{session}/events?format=json")).json()
                facts: list[dict[str, object]] = page["facts"]
                done = any(
                    f["kind"] == "assistant" and seq in f["data"].get("inputSeqs", [])  # type: ignore[union-attr]
                    for f in facts
                )
                return facts if done else None

            facts = await eventually(answered, "the new runner to finish the answer", 60)
        epochs = [f["data"]["epoch"] for f in facts if f["kind"] == "epoch_started"]  # type: ignore[index]
        assert len(epochs) >= 2 and epochs == sorted(epochs)
        answers = [f for f in facts if f["kind"] == "assistant"]
        assert len(answers) == 1, "exactly one final reply"
        assert [f["seq"] for f in facts] == list(range(1, len(facts) + 1))
    finally:
        await asyncio.to_thread(child.terminate, 30)
