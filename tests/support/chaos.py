"""`keel chaos` in tests: hand-made facts for its checks, and the command
run as users run it against a `keel up` of the test's own."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any

from tests.support.keel_up import KEEL, RunningKeel, clean_env
from tests.support.processes import ROOT
from tests.support.stale_race import Refusal, refusals_in

# Fails a hung run; a round normally takes seconds.
CHAOS_DEADLINE_S = 240.0


def fact(seq: int, kind: str, epoch: int = 0, /, **data: Any) -> dict[str, Any]:
    """A fact as the public API returns it."""
    return {"seq": seq, "kind": kind, "timestamp": 0, "epoch": epoch, "data": data}


def started(seq: int, epoch: int) -> dict[str, Any]:
    return fact(seq, "epoch_started", epoch, epoch=epoch, runtimeId="rt-x", watermark=seq - 1)


def answer(seq: int, epoch: int, *inputs: int, calls: tuple[str, ...] = ()) -> dict[str, Any]:
    """An assistant fact: final (answering `inputs`) unless it has `calls`."""
    data: dict[str, Any] = {
        "generationId": f"gen-{seq}",
        "toolCalls": [{"id": c, "name": "counter", "arguments": {}} for c in calls],
    }
    if not calls:
        data["inputSeqs"] = list(inputs)
    return fact(seq, "assistant", epoch, **data)


def healthy_session() -> list[dict[str, Any]]:
    """Two turns, a tool call, and a takeover: everything in order."""
    return [
        fact(1, "session_created", tenant="default"),
        fact(2, "input", text="/tool counter {}", requestId="r1"),
        started(3, 1),
        answer(4, 1, calls=("call-a",)),
        fact(5, "tool_result", 1, toolCallId="call-a", content="1", isError=False),
        # The owner died here; its successor raises the fence and finishes.
        started(6, 2),
        answer(7, 2, 2),
        fact(8, "input", text="hello", requestId="r2"),
        started(9, 3),
        answer(10, 3, 8),
    ]


@dataclass(frozen=True)
class ChaosOutcome:
    code: int
    stdout: str
    stderr: str

    @property
    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = json.loads(self.stdout)
        return report

    def rules(self) -> set[str]:
        return {v["rule"] for v in self.report["violations"]}


def run_chaos(up: RunningKeel, *args: str) -> ChaosOutcome:
    """`keel chaos --url … --key … ARGS` against `up`, to its end."""
    done = subprocess.run(
        [str(KEEL), "chaos", "--url", up.url, "--key", up.key, *args],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=CHAOS_DEADLINE_S,
        check=False,
    )
    return ChaosOutcome(done.returncode, done.stdout, done.stderr)


def ledger_refusals(up: RunningKeel) -> list[Refusal]:
    """The stale appends the ledger of `up` refused, as it logged them
    (`keel up` prints each child's lines after a `[name pid]` prefix)."""
    lines = [line.split("] ", 1)[1] for line in up.child.lines if line.startswith("[ledger")]
    return refusals_in(lines)
