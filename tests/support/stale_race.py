"""A stale owner that really races, for the runner and ledger tests.

Every runner of a race runs with `KEEL_FAULT_ACTION=stop` and the same
`KEEL_FAULT_TRIGGER` file (services/common/faults.py). A round arms the
trigger with a point right before a write and sends a session two counter
calls; whichever runner claims it takes the trigger and stops itself there,
its tool effects (if any) done and the write not yet sent. Its lease runs out
(its Attach stream stays open, so only the TTL ends it), the other runner
takes the session with epoch+1 and answers it. Then the stopped owner is
resumed: its first act is the write, with the old epoch, and the round
fails unless the ledger reports refusing exactly that write (`Refusal`, read
from the ledger's own log where the refusal is decided, so it is seen even
when the resumed runner learns of its lost lease first and gives up on the
call). The round then checks that nothing of the old epoch landed after the
successor's `epoch_started`, that each counter was applied once, and the
session's answer.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent_io.tools.builtin import CounterEffects
from kernel import KernelClient
from services.ledger import LedgerClient
from tests.support.ledger_invariants import assert_handed_over, assert_recovered
from tests.support.polling import eventually
from tests.support.processes import ChildProcess
from tests.support.tool_fixtures import alive, stopped

TWO_COUNTERS = '/tool counter {{"key": "{session}-a"}} | counter {{"key": "{session}-b"}}'
# The fault point right before each write a stale owner can race with, and
# the kind of that write.
WRITES = {
    "before_assistant_commit": "assistant",
    "mid_tool": "tool_result",
    "before_final_answer": "assistant",
}
# How often each counter ran by the time the round is over: the stale owner
# runs call a before its stop at mid_tool (the successor runs it again), and
# both calls before its stop at the final answer.
EXECUTIONS = {
    "before_assistant_commit": (1, 1),
    "mid_tool": (2, 1),
    "before_final_answer": (1, 1),
}
# Runners ask the kernel for work in short polls, so a claim sent just before
# a runner stopped has expired before its lease does, and the successor (not
# the stopped runner's parked claim) is handed the session.
CLAIM_WAIT_MS = "200"
_REFUSED = re.compile(r"stale append refused: session=(\S+) epoch=(\d+) fence=(\d+) kinds=(\S*)")


@dataclass(frozen=True)
class Refusal:
    """One append the ledger's fence refused (STALE_EPOCH)."""

    session: str
    epoch: int
    fence: int
    kinds: tuple[str, ...]


def parse_refusal(message: str) -> Refusal | None:
    match = _REFUSED.search(message)
    if match is None:
        return None
    session, epoch, fence, kinds = match.groups()
    return Refusal(session, int(epoch), int(fence), tuple(k for k in kinds.split(",") if k))


def refusals_in(lines: Sequence[str]) -> list[Refusal]:
    """The refusals a ledger process logged (JSON lines on its output)."""
    found = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("logger") == "services.ledger.servicer":
            refusal = parse_refusal(str(entry.get("msg", "")))
            if refusal is not None:
                found.append(refusal)
    return found


class _Collected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.refusals: list[Refusal] = []

    def emit(self, record: logging.LogRecord) -> None:
        refusal = parse_refusal(record.getMessage())
        if refusal is not None:
            self.refusals.append(refusal)


@contextmanager
def ledger_refusals() -> Iterator[Callable[[], list[Refusal]]]:
    """The refusals of the ledgers running in this process, as they log them."""
    logger = logging.getLogger("services.ledger.servicer")
    handler = _Collected()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lambda: list(handler.refusals)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class Trigger:
    """The file that arms one fault point for whichever runner reaches it first."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def env(self) -> dict[str, str]:
        return {"KEEL_FAULT_TRIGGER": str(self.path), "KEEL_FAULT_ACTION": "stop"}

    def arm(self, point: str) -> None:
        for taken in self.path.parent.glob(self.path.name + ".*"):
            taken.unlink()
        # Staged under a name the runners never look at, then renamed.
        staged = self.path.with_name(f".{self.path.name}.staged")
        staged.write_text(point)
        os.replace(staged, self.path)  # a runner never reads half a file

    async def taken_by(self) -> int | None:
        taken = list(self.path.parent.glob(self.path.name + ".*"))
        return int(taken[0].suffix[1:]) if taken else None


@dataclass(frozen=True)
class RaceRunner:
    process: ChildProcess
    runtime_id: str


@dataclass(frozen=True)
class RaceOutcome:
    stale: RaceRunner
    successor: RaceRunner
    refusal: Refusal


@dataclass
class StaleRace:
    """One ledger and kernel (reached through these clients), runners
    sharing one trigger, and where the ledger's refusals are read."""

    ledger: LedgerClient
    kernel: KernelClient
    runners: list[RaceRunner]
    trigger: Trigger
    refusals: Callable[[], list[Refusal]]
    counters: CounterEffects

    async def round(self, session: str, point: str, deadline_s: float = 30.0) -> RaceOutcome:
        """One race: the owner stopped right before the write of `point`."""
        self.trigger.arm(point)
        await self.ledger.create_session(session, "default")
        text = TWO_COUNTERS.format(session=session)
        seq = (
            await self.ledger.append_one(session, "input", {"text": text, "requestId": "r1"})
        ).seq
        await self.kernel.enqueue(session, "default", input_seq=seq)

        pid = await eventually(self.trigger.taken_by, f"a runner to reach {point}", deadline_s)
        stale = next(r for r in self.runners if r.process.pid == pid)
        successor = next(r for r in self.runners if r is not stale)
        try:
            await eventually(lambda: _true(stopped(pid)), "the owner to stop itself", deadline_s)
            await self.settled(session, deadline_s)
        finally:
            os.kill(pid, signal.SIGCONT)

        async def refused() -> Refusal | None:
            found = next((r for r in self.refusals() if r.session == session), None)
            if found is None:
                # A stale write that landed fails here, at once.
                assert_handed_over(await self.ledger.read_all(session), *ids)
            return found

        ids = (stale.runtime_id, successor.runtime_id)
        refusal = await eventually(
            refused, f"the ledger to refuse the stale write to {session}", deadline_s
        )
        assert alive(pid), "the stale owner was refused, not killed"

        facts = await self.ledger.read_all(session)
        assert_recovered(facts)
        old_epoch = assert_handed_over(facts, *ids)
        assert refusal == Refusal(session, old_epoch, old_epoch + 1, (WRITES[point],)), refusal
        answers = [f for f in facts if f.kind == "assistant" and f.data.get("inputSeqs")]
        assert [a.data["inputSeqs"] for a in answers] == [[seq]], "answered once"
        assert answers[0].epoch == old_epoch + 1
        # Each counter read 1 (a rerun under the same key does not count
        # again), and the answer says so for both.
        shown = str(answers[0].data["content"])
        assert shown.count("Tool counter returned") == shown.count('"value": 1') == 2, shown
        executions = tuple(self.counters.executions(f"{session}-{c}") for c in "ab")
        assert executions == EXECUTIONS[point], executions
        assert all(self.counters.value(f"{session}-{c}") == 1 for c in "ab"), "applied once"
        return RaceOutcome(stale, successor, refusal)

    async def settled(self, session: str, deadline_s: float) -> None:
        async def probe() -> bool | None:
            view = await self.ledger.get_session(session)
            if view.owed_input_seqs or view.open_tool_calls:
                return None
            lease = await self.kernel.get_lease(session)
            return True if lease.lease is None and not lease.queued else None

        await eventually(probe, f"the successor to answer {session}", deadline_s)


async def runtime_id(runner: ChildProcess) -> str:
    """The runner's id, from the line it prints once it serves."""
    line = await runner.line(lambda text: text.startswith("runner ") and " listening on " in text)
    return line.split()[1]


async def _true(value: bool) -> bool | None:
    return True if value else None
