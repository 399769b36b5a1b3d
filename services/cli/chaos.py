"""`keel chaos`: crash and hand off a running deployment's runners while
sessions run, then check from the ledger that nothing was lost or doubled.

Everything goes through the edge's public HTTP API with an operator key:
sessions are created and driven with inputs (`/slow` answers, `/tool
counter` calls, plain text), the runtimes are found in `/v1/runtime/status`,
and the facts are read back as pages for the checks (services/session_invariants.py).
Each round sends a wave of inputs, waits until a runner holds some of the
sessions, strikes, sends a second wave while the fault is under way (clients
do not stop), and waits for every input's answer.

- `crash`: SIGKILL of a runner process. Only a pid the status reports for
  this host, that is alive and whose command line is a Keel runner, is ever
  signalled; where no runner runs on this host the round says so and
  strikes nothing.
- `handoff`: `POST /v1/runtime/drain {runtimeId, mode: handoff}` for a
  claiming runner: it settles at a commit boundary and releases its
  sessions. A drained runner is not expected back: another runner, or the
  runtime that replaces it (`keel up --processes`, a Kubernetes rollout),
  takes the sessions.
- `stale`: a stale owner racing its successor (services/cli/chaos_stale.py):
  SIGSTOP of a runner process (the same pids as `crash`) while it runs its
  sessions' tool calls, until another runner has taken each of them over and
  committed, then SIGCONT. The resumed runner goes on where it stopped and
  writes with its old epoch; the ledger's fence must refuse every such write
  (the ledger logs each refusal, `keel.ledger.fence`, and counts it,
  `keel.ledger.stale_appends`), so the checks find no fact of the old epoch
  after the successor's.

`--seed` fixes every choice chaos makes (inputs, targets, when to strike);
what the deployment does in reply is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from services.cli.chaos_report import ChaosReport, RoundResult, progress_line, render
from services.cli.chaos_stale import StaleStrike, stale_inputs, stop_until_taken_over
from services.runner.events import IDLE
from services.session_invariants import Violation, check_session

SCENARIOS = ("crash", "handoff", "stale")
# What a run strikes with when no scenario is named.
DEFAULT_SCENARIOS = ("crash", "handoff")
PAGE_LIMIT = 1000
# How long a round waits for a runner to hold one of its sessions before it
# strikes whichever runner it can.
TARGET_WAIT_S = 15.0
# Transient failures of the edge (a restart, a proxy's 502-504) are retried
# for this long: a client that gives up at once would report its own
# impatience as lost inputs.
RETRY_S = 30.0
POLL_S = 0.1
# The most a round waits after choosing its target before striking, so the
# fault lands anywhere in a stream or tool call, not always at its start.
STRIKE_JITTER_S = 0.5


class ChaosError(Exception):
    """The run could not go on (the edge refused it or is unreachable)."""


@dataclass(frozen=True)
class ChaosOptions:
    url: str
    key: str
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    rounds: int = 2
    sessions: int = 6
    seed: int = 0
    # How long a round waits for every input's answer.
    timeout_s: float = 120.0
    drain_deadline_ms: int = 30_000


@dataclass
class Tracked:
    """One session of the run: the input seqs sent and the facts read so far."""

    id: str
    index: int
    sent: list[int] = field(default_factory=list)
    facts: list[dict[str, Any]] = field(default_factory=list)

    def waiting(self) -> bool:
        answered = {
            seq
            for fact in self.facts
            if fact["kind"] == "assistant"
            for seq in fact["data"].get("inputSeqs") or ()
        }
        return not answered.issuperset(self.sent)


@dataclass(frozen=True)
class Target:
    runtime_id: str
    pid: int | None
    held: int


def keel_runner_pid(pid: int) -> bool:
    """Whether `pid` is a live Keel runner process of this host: its command
    line is `keel runner …`, `python -m services.cli.main runner …` or
    `python -m services.runner …` (a zombie's command line is empty)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    args = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    if "services.runner" in args:
        return True
    keel = any(Path(arg).name == "keel" or arg == "services.cli.main" for arg in args[:3])
    return keel and "runner" in args


class EdgeApi:
    """The public HTTP API, with transient failures retried."""

    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        deadline = time.monotonic() + RETRY_S
        while True:
            try:
                response = await self.http.request(method, path, **kwargs)
            except httpx.TransportError as error:
                problem = f"{type(error).__name__}: {error}"
            else:
                if response.status_code not in (502, 503, 504):
                    if response.is_error:
                        raise ChaosError(
                            f"{method} {path}: {response.status_code} {response.text[:300]}"
                        )
                    return response.json()
                problem = f"{response.status_code} {response.text[:300]}"
            if time.monotonic() > deadline:
                raise ChaosError(f"{method} {path}: {problem}")
            await asyncio.sleep(0.2)

    async def facts(self, session: str, after: int = 0) -> list[dict[str, Any]]:
        """Every fact after `after`, page by page."""
        found: list[dict[str, Any]] = []
        while True:
            page = await self.call(
                "GET",
                f"/v1/sessions/{session}/events",
                params={"format": "json", "after": after, "limit": PAGE_LIMIT},
            )
            found.extend(page["facts"])
            if not page["facts"] or page["next"] >= page["headSeq"]:
                return found
            after = page["next"]

    async def runners(self) -> list[dict[str, Any]]:
        runtimes = (await self.call("GET", "/v1/runtime/status"))["runtimes"]
        return [r for r in runtimes if r.get("role") == "runner"]


class ChaosRun:
    def __init__(self, options: ChaosOptions, api: EdgeApi, say: Callable[[str], None]) -> None:
        self.options = options
        self.api = api
        self.say = say
        self.rng = random.Random(options.seed)
        # Request ids stay unique when a seed is run again on the same deployment.
        self.run_id = f"{options.seed}-{secrets.token_hex(3)}"
        self.sessions: list[Tracked] = []

    async def run(self) -> ChaosReport:
        runners = await self.api.runners()
        if runners and "pid" not in runners[0]:
            raise ChaosError("the key is not an operator key (runtimes come without pids)")
        for index in range(self.options.sessions):
            created = await self.api.call("POST", "/v1/sessions", json={})
            self.sessions.append(Tracked(created["id"], index))
        results: list[RoundResult] = []
        plan = [(n + 1, s) for n in range(self.options.rounds) for s in self.options.scenarios]
        for number, scenario in plan:
            result = await self.round(number, scenario)
            results.append(result)
            self.say(progress_line(result))
            if not result.answered:
                self.say("inputs went unanswered: the remaining rounds are not run")
                break
        if all(r.answered for r in results):
            # After a round that timed out there is nothing left to wait for.
            await self.settle()
        violations: list[Violation] = []
        facts = 0
        for tracked in self.sessions:
            # Read afresh: what the ledger holds now is what is checked.
            read = await self.api.facts(tracked.id)
            facts += len(read)
            violations.extend(check_session(tracked.id, read))
        return ChaosReport(
            url=self.options.url,
            seed=self.options.seed,
            scenarios=self.options.scenarios,
            rounds=tuple(results),
            sessions=tuple(s.id for s in self.sessions),
            inputs=sum(len(s.sent) for s in self.sessions),
            facts=facts,
            violations=tuple(violations),
        )

    async def round(self, number: int, scenario: str) -> RoundResult:
        started = time.monotonic()
        sent = await self.wave(f"{scenario}{number}", "a")
        target = await self.target(scenario)
        note = ""
        drain: asyncio.Task[Any] | None = None
        stale: asyncio.Task[StaleStrike] | None = None
        if target is None:
            note = (
                "no claiming runner: nothing drained"
                if scenario == "handoff"
                else "nothing struck: no runner of this host runs in a process of its own"
            )
        else:
            await asyncio.sleep(self.rng.uniform(0, STRIKE_JITTER_S))
            if scenario == "crash":
                note = _kill(target)
            elif scenario == "stale":
                assert target.pid is not None  # a target of this host has its pid
                stale = asyncio.create_task(
                    stop_until_taken_over(
                        self.api,
                        target.runtime_id,
                        target.pid,
                        [s.id for s in self.sessions],
                        self.options.timeout_s,
                        keel_runner_pid,
                    )
                )
            else:
                body = {
                    "runtimeId": target.runtime_id,
                    "mode": "handoff",
                    "deadlineMs": self.options.drain_deadline_ms,
                }
                timeout = self.options.drain_deadline_ms / 1000 + 30
                drain = asyncio.create_task(
                    self.api.call("POST", "/v1/runtime/drain", json=body, timeout=timeout)
                )
        # Clients keep sending while the fault is under way.
        sent += await self.wave(f"{scenario}{number}", "b")
        raced = 0
        held = target.held if target else 0
        if stale is not None:
            strike = await stale
            # What it held when stopped, which is what could race.
            note, held, raced = strike.note, strike.held, strike.raced
        if drain is not None:
            try:
                drained = await drain
            except ChaosError as error:
                note = f"drain failed: {error}"
            else:
                assert target is not None
                in_flight = (drained.get("runtimes") or {}).get(target.runtime_id)
                # Runs still going at the drain's deadline are stopped where they are.
                stopped = (drained.get("stopped") or {}).get(target.runtime_id) or 0
                note = f"handoff drain ({in_flight} in flight, {stopped} stopped)"
        answered = await self.until_answered(time.monotonic() + self.options.timeout_s)
        return RoundResult(
            number=number,
            scenario=scenario,
            target=target.runtime_id if target else "",
            pid=target.pid if target else None,
            held=held,
            inputs=sent,
            answered=answered,
            seconds=time.monotonic() - started,
            note=note,
            raced=raced,
        )

    def inputs_for(self, tracked: Tracked, step: str, wave: str) -> list[str]:
        """A seeded mix: the first wave keeps runners busy (slow answers and
        tool calls), the second is whatever a client might send next."""
        label = f"chaos {self.run_id} {step}{wave} session {tracked.index}"
        if wave == "a" and step.startswith("stale"):
            # Runners are to be stopped inside a call, before its result.
            return stale_inputs(self.rng)
        slow = f"/slow {self.rng.choice((0.5, 1.0, 1.5, 2.0))} {label}"
        tool = "/tool counter " + json.dumps({"key": f"chaos-{self.run_id}-{tracked.index}"})
        if wave == "a":
            # Always a slow answer, so each session is still running when
            # the fault comes (a tool call alone is over in milliseconds).
            return self.rng.choice(([slow], [slow, tool], [tool, slow]))
        return self.rng.choice(([], [label], [f"/slow 0.5 {label}"], [tool]))

    async def wave(self, step: str, wave: str) -> int:
        """Sends each session its inputs of `step` (e.g. crash2) and `wave`."""
        planned = [(t, self.inputs_for(t, step, wave)) for t in self.sessions]

        async def send(tracked: Tracked, texts: list[str]) -> None:
            for n, text in enumerate(texts):
                body = {"text": text, "requestId": f"chaos-{self.run_id}-{step}{wave}-{n}"}
                committed = await self.api.call(
                    "POST", f"/v1/sessions/{tracked.id}/inputs", json=body
                )
                tracked.sent.append(int(committed["seq"]))

        await asyncio.gather(*(send(t, texts) for t, texts in planned))
        return sum(len(texts) for _, texts in planned)

    async def target(self, scenario: str) -> Target | None:
        """The runner to strike: one holding the most of this run's sessions,
        once one holds any (else, after a while, any that qualifies)."""
        ours = {s.id for s in self.sessions}
        deadline = time.monotonic() + TARGET_WAIT_S
        while True:
            held: dict[str, tuple[int, int | None]] = {}
            for runner in await self.api.runners():
                if _qualifies(runner, scenario):
                    count = sum(1 for s in runner.get("sessions") or () if s.get("id") in ours)
                    held[runner["runtimeId"]] = (count, runner.get("pid"))
            best = max((count for count, _ in held.values()), default=0)
            if held and (best > 0 or time.monotonic() > deadline):
                chosen = self.rng.choice(sorted(r for r, (c, _) in held.items() if c == best))
                return Target(chosen, held[chosen][1], best)
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(POLL_S)

    async def refresh(self, tracked: Tracked) -> None:
        after = tracked.facts[-1]["seq"] if tracked.facts else 0
        tracked.facts.extend(await self.api.facts(tracked.id, after))

    async def until_answered(self, deadline: float) -> bool:
        while True:
            waiting = [s for s in self.sessions if s.waiting()]
            if not waiting:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.gather(*(self.refresh(s) for s in waiting))
            if any(s.waiting() for s in waiting):
                await asyncio.sleep(POLL_S)

    async def settle(self) -> None:
        """Waits (up to the round timeout) until every session is idle and
        owes nothing, so whatever a runner still writes is in the final read."""
        deadline = time.monotonic() + self.options.timeout_s
        pending = list(self.sessions)
        while pending and time.monotonic() < deadline:
            views = await asyncio.gather(
                *(self.api.call("GET", f"/v1/sessions/{s.id}") for s in pending)
            )
            pending = [
                s
                for s, view in zip(pending, views, strict=True)
                if view["status"] != IDLE or view["owedInputs"]
            ]
            if pending:
                await asyncio.sleep(POLL_S)


def _qualifies(runner: dict[str, Any], scenario: str) -> bool:
    if scenario == "handoff":
        return bool(runner.get("claiming")) and runner.get("drainMode") in ("none", "", None)
    pid = runner.get("pid")
    return (
        runner.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and pid > 0
        and keel_runner_pid(pid)
    )


def _kill(target: Target) -> str:
    # Checked again right before the signal: the pid must still be a runner.
    if target.pid is None or not keel_runner_pid(target.pid):
        return f"pid {target.pid} is no longer a runner: nothing killed"
    try:
        os.kill(target.pid, signal.SIGKILL)
    except ProcessLookupError:
        return f"pid {target.pid} exited before the kill"
    except PermissionError:
        return f"not permitted to signal pid {target.pid}: nothing killed"
    return f"SIGKILL pid {target.pid}"


async def run_chaos(options: ChaosOptions, say: Callable[[str], None]) -> ChaosReport:
    api = EdgeApi(options.url, options.key)
    try:
        return await ChaosRun(options, api, say).run()
    finally:
        await api.close()


def parse_scenarios(raw: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))
    unknown = [name for name in names if name not in SCENARIOS]
    if not names or unknown:
        raise ValueError(f"--scenarios: expected a comma-separated list of {', '.join(SCENARIOS)}")
    return names


def run_command(options: ChaosOptions, as_json: bool) -> int:
    """Runs `keel chaos`; the exit code: 0 clean, 1 a violation, 2 the run
    could not be made."""

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        report = asyncio.run(run_chaos(options, say))
    except ChaosError as error:
        say(f"keel chaos: {error}")
        return 2
    if as_json:
        with contextlib.suppress(BrokenPipeError):
            print(json.dumps(report.to_json()), flush=True)
    else:
        console = Console()
        # Not a terminal (a pipe, a CI log): wide enough for a row per round.
        render(report, console if console.is_terminal else Console(width=160))
    return 0 if report.ok else 1
