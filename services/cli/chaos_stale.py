"""`keel chaos --scenarios stale`: a stale owner racing its successor.

A round's first wave gives every session a tool call that takes seconds (a
`sleep`), so a runner holding sessions is inside a call, its result not yet
written, when chaos stops it (SIGSTOP, the same local
runner pids the `crash` scenario kills). Stopped, it cannot renew its
leases: they run out and another runner takes each session over with a
newer epoch, reruns the call and commits. Only then is the stopped runner
resumed (SIGCONT). It goes on where it stopped: its call returns and it
writes the result with its old epoch, before it can learn that its lease is
gone. The ledger's fence must refuse that write (the ledger logs and counts
each refusal); the run's checks then find no fact of the old epoch after
the successor's `epoch_started` and one result per call.

A round counts as raced for a session the stopped runner held once a
successor has committed to it: that is when the stale write comes too late.
The runner is resumed however the round ends (an error, Ctrl-C); only if
chaos itself is killed meanwhile does it stay stopped (`kill -CONT <pid>`),
its sessions taken over all the same.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# The call a runner is stopped in: long enough that the strike (at most
# STRIKE_JITTER_S after a runner holds a session) lands inside it.
SLEEP_CHOICES_S = (2.0, 2.5, 3.0)
POLL_S = 0.2


class Api(Protocol):
    async def runners(self) -> list[dict[str, Any]]: ...

    async def facts(self, session: str, after: int = 0) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class StaleStrike:
    """What one stop did: how long the runner was stopped, the run's
    sessions it held then, and how many of them a successor committed to
    before it was resumed."""

    note: str
    held: int = 0
    raced: int = 0


def stale_inputs(rng: random.Random) -> list[str]:
    """One call that takes seconds: a runner holding the session is most
    likely inside it when stopped, and its result is its next write."""
    seconds = rng.choice(SLEEP_CHOICES_S)
    return [f'/tool sleep {{"seconds": {seconds}}}']


def owner_epoch(facts: Sequence[Mapping[str, Any]], runtime_id: str) -> int | None:
    """The latest epoch `runtime_id` started in a session, if any."""
    epochs = [
        int(f["data"]["epoch"])
        for f in facts
        if f["kind"] == "epoch_started" and f["data"].get("runtimeId") == runtime_id
    ]
    return max(epochs, default=None)


def successor_committed(facts: Sequence[Mapping[str, Any]], epoch: int) -> bool:
    """Whether a newer owner than `epoch` has written more than its start."""
    return any(int(f.get("epoch") or 0) > epoch and f["kind"] != "epoch_started" for f in facts)


async def stop_until_taken_over(
    api: Api,
    runtime_id: str,
    pid: int,
    sessions: Sequence[str],
    deadline_s: float,
    is_runner: Callable[[int], bool],
) -> StaleStrike:
    """SIGSTOPs `pid`, waits until a successor committed to each of the
    run's `sessions` it held, and SIGCONTs it, whatever happens meanwhile."""
    if not is_runner(pid):
        return StaleStrike(f"pid {pid} is no longer a runner: nothing stopped")
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return StaleStrike(f"pid {pid} exited before the stop")
    except PermissionError:
        return StaleStrike(f"not permitted to signal pid {pid}: nothing stopped")
    stopped_at = time.monotonic()
    try:
        # Read once it is stopped: what it holds now, it holds until resumed.
        held = await _held(api, runtime_id, sessions)
        raced = await _until_successors(api, held, stopped_at + deadline_s)
    finally:
        # Checked again: never signal a pid that is no longer the runner.
        if is_runner(pid):
            os.kill(pid, signal.SIGCONT)
    stopped_s = time.monotonic() - stopped_at
    return StaleStrike(
        f"SIGSTOP pid {pid} for {stopped_s:.1f}s: a successor committed to "
        f"{raced} of the {len(held)} sessions it held; SIGCONT",
        held=len(held),
        raced=raced,
    )


async def _held(api: Api, runtime_id: str, sessions: Sequence[str]) -> dict[str, int]:
    """The run's sessions the runtime holds, with the epoch it holds them by."""
    ours = set(sessions)
    held: dict[str, int] = {}
    for runner in await api.runners():
        if runner.get("runtimeId") != runtime_id:
            continue
        for entry in runner.get("sessions") or ():
            session = entry.get("id")
            if session in ours:
                epoch = owner_epoch(await api.facts(session), runtime_id)
                if epoch is not None:
                    held[session] = epoch
    return held


async def _until_successors(api: Api, held: Mapping[str, int], deadline: float) -> int:
    waiting = dict(held)
    while waiting and time.monotonic() < deadline:
        read = await asyncio.gather(*(api.facts(s) for s in waiting))
        for session, facts in zip(list(waiting), read, strict=True):
            if successor_committed(facts, waiting[session]):
                del waiting[session]
        if waiting:
            await asyncio.sleep(POLL_S)
    return len(held) - len(waiting)
