"""The hops and commits of one turn, counted exactly, so an extra one fails here.

A turn is what `keel bench turns` times: a client commits an input and wakes
the kernel; the runner claims the session, reads what it lacks, writes the
fence and the answer, and finishes; then it waits in its next claim. With a
sticky window (KEEL_STICKY_MS, on by default) a warm turn skips the claim, the
new epoch and its fence: the kernel sends the input's wake down the
runner's LeaseStream, and the runner's claim, long-polling, stays where it
was. Both are counted: the sticky table is a warm turn's, the other a
runner asking for no window. Every
service runs in this process (real gRPC on loopback, PostgreSQL), so the
per-process counters of services/common/hops.py see every RPC the servers
received and every transaction the stores committed.

Only the turn is counted. What runs on a timer is kept out of the window by
giving every timer a period far longer than the test (and by waiting, before
the first count, for the passes each one makes at start-up):
- lease renewals: the lease is 10 minutes, an attempt renews after a third;
- the kernel's runtime heartbeats, lease sweeps and reconciler passes;
- the runner's claim long poll, which would come back empty and be sent
  again every `claim_wait_ms`;
- the runner's cancel watch, a Subscribe an attempt opens once it has run
  for `CANCEL_WATCH_DELAY_S` (a slow machine could cross 100 ms).
The kernel's claim re-checks and the Attach stream's heartbeats are not hops
(no RPC received, nothing written), so they need no exclusion.

A turn is over once every count of the tables below is reached and the
runner is done with it: a cold turn's last hop is the runner's next claim,
sent after Finish; a warm turn's is its answer, and the runner is done once
it keeps the session again (it would have sent a Finish before that). So
each turn's window ends at the same point. A hop too many fails the
comparison; one too few times out. Both failures print the table observed.

When the hot path changes (a pipelined AppendStream, a lease stream), update
the two tables and NEXT_CLAIM: the stream servicers count each message they
handle under their own method names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from kernel import KernelServer
from services.common import hops
from services.common.config import Settings
from services.ledger import CommittedFact
from services.runner import settling
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.polling import eventually

LEDGER = "keel.ledger.v1.LedgerService/"
KERNEL = "keel.kernel.v1.KernelService/"

# RPCs (or stream messages) the servers receive per turn, by method.
COLD_CALLS_PER_TURN = {
    # Messages of the clients' AppendStreams: the client's input; the
    # runner's epoch_started and answer.
    LEDGER + "AppendStream": 3,
    KERNEL + "Enqueue": 1,  # the client wakes the kernel
    # Messages of the runner's LeaseStream: its Finish (the lease given back,
    # the watermark recorded), then its next claim, whose answer brings the
    # loadout revision (no GetLoadout).
    KERNEL + "LeaseStream": 2,
    LEDGER + "Read": 1,  # the fact cache reads what came after its tail (the input)
}
# Write transactions committed per turn, by store.
COLD_COMMITS_PER_TURN = {
    "ledger": 3,  # one per append (the appends of one turn never share a batch)
    "kernel": 3,  # enqueue, claim, finish
}
# A warm turn of a sticky session: the runner already holds the lease's
# epoch. Three hops and three commits: nothing but the turn's own writes.
STICKY_CALLS_PER_TURN = {
    # The client's input; the runner's answer, which carries its Finish:
    # the ledger settles the lease in the answer's transaction, keeping the
    # session for the runner again (kernel/turn_settlement.py).
    LEDGER + "AppendStream": 2,
    # The client wakes the kernel, handing it the input, and the kernel
    # wakes the runner with it: the runner reads nothing.
    KERNEL + "Enqueue": 1,
}
STICKY_COMMITS_PER_TURN = {
    "ledger": 2,  # the input; the answer with the lease's settlement
    "kernel": 1,  # the enqueue with its wake
}
STICKY_MS = 600_000
# What the runner sends last in a turn (after Finish): its next claim, a
# message of the same stream as the Finish (so a turn is over once the
# stream has handled both).
NEXT_CLAIM = KERNEL + "LeaseStream"

TURNS = 3
A_LONG_TIME_MS = 600_000


@dataclass
class Quiet:
    cluster: Cluster
    runner: RunnerServer

    @property
    def kernel_server(self) -> KernelServer:
        return self.cluster.kernel_server

    def keeps(self, session_id: str) -> bool:
        """The runner is done with the session's turn and keeps it."""
        runtime = self.runner.runtime
        assert runtime is not None
        return session_id in runtime.intake.sticky and session_id not in runtime.in_flight


@dataclass(frozen=True)
class Expected:
    calls: dict[str, int]
    commits: dict[str, int]


@pytest.fixture(params=[0, STICKY_MS], ids=["cold", "sticky"])
def sticky_ms(request: pytest.FixtureRequest) -> int:
    value: int = request.param
    return value


@pytest.fixture
def expected(sticky_ms: int) -> Expected:
    if sticky_ms:
        return Expected(STICKY_CALLS_PER_TURN, STICKY_COMMITS_PER_TURN)
    return Expected(COLD_CALLS_PER_TURN, COLD_COMMITS_PER_TURN)


@pytest.fixture
async def quiet(
    pg_settings: Settings, monkeypatch: pytest.MonkeyPatch, sticky_ms: int
) -> AsyncIterator[Quiet]:
    """Ledger, kernel and runner in this process, every timer slowed down."""
    monkeypatch.setattr(settling, "CANCEL_WATCH_DELAY_S", A_LONG_TIME_MS / 1000)
    settings = pg_settings.with_overrides(lease_ms=A_LONG_TIME_MS)
    cluster = await start_cluster(
        settings,
        reconcile_ms=A_LONG_TIME_MS,
        sweep_ms=A_LONG_TIME_MS,
        runtime_heartbeat_ms=A_LONG_TIME_MS,
        runtime_dead_after_ms=2 * A_LONG_TIME_MS,
    )
    runner: RunnerServer | None = None
    try:
        started = hops.snapshot()
        runner = await RunnerServer(
            settings,
            RunnerConfig(
                cluster.ledger_server.target,
                cluster.kernel_server.target,
                concurrency=1,
                claim_wait_ms=300_000,
                sticky_ms=sticky_ms,
            ),
        ).start()
        quiet = Quiet(cluster, runner)
        # The start-up passes of the timers, and the runner's first claim.
        reconciler, heartbeats = quiet.kernel_server.reconciler, quiet.kernel_server.heartbeats
        assert reconciler is not None and heartbeats is not None
        await eventually(lambda: reconciler.passes >= 1, "the reconciler's first pass")
        await eventually(lambda: heartbeats.rounds >= 1, "the first heartbeat round")
        await eventually(lambda: _claims(hops.snapshot().since(started)) >= 1, "the runner's claim")
        yield quiet
    finally:
        if runner is not None:
            await runner.stop(grace=0.2)
        await stop_cluster(cluster)


def _claims(spent: hops.Hops) -> int:
    return spent.calls.get(NEXT_CLAIM, 0)


def _reached(spent: hops.Hops, expected: Expected, claims_only: bool = False) -> bool:
    """Whether one turn's worth of every expected count (or of the runner's
    LeaseStream messages alone: its Finish, unless the answer carried it,
    and its next claim) has been counted."""
    if claims_only:
        finish_and_claim = 1 if expected.calls is STICKY_CALLS_PER_TURN else 2
        return _claims(spent) >= finish_and_claim
    calls = all(spent.calls.get(m, 0) >= n for m, n in expected.calls.items())
    commits = all(spent.commits.get(s, 0) >= n for s, n in expected.commits.items())
    return calls and commits


async def _turn(
    quiet: Quiet,
    stream: AsyncIterator[CommittedFact],
    session_id: str,
    n: int,
    expected: Expected,
    *,
    warm_up: bool = False,
) -> None:
    """One turn, until the runner has sent its next claim."""
    before = hops.snapshot()
    seq = await quiet.cluster.send(session_id, f"question {n}", f"r{n}")
    async for fact in stream:
        if fact.kind == "assistant" and seq in (fact.data.get("inputSeqs") or ()):
            break
    # The answer is seen before the attempt finishes; its Finish and the
    # runner's next claim belong to the turn all the same. (The warm-up turn
    # makes other hops besides: only its claims tell when it is over.)
    sticky = expected.calls is STICKY_CALLS_PER_TURN
    await eventually(
        lambda: (
            _reached(hops.snapshot().since(before), expected, claims_only=warm_up)
            and (not sticky or quiet.keeps(session_id))
        ),
        f"turn {n} to be over",
        detail=lambda: _observed(hops.snapshot().since(before), 1),
    )


def _table(counts: dict[str, int], turns: int) -> str:
    return "\n".join(f"  {name}: {n / turns:g}" for name, n in sorted(counts.items()))


def _observed(spent: hops.Hops, turns: int) -> str:
    return (
        f"observed per turn, over {turns} turn(s):\ncalls\n{_table(spent.calls, turns)}\n"
        f"commits\n{_table(spent.commits, turns)}"
    )


async def test_a_turn_makes_exactly_the_expected_calls_and_commits(
    quiet: Quiet, expected: Expected, sticky_ms: int
) -> None:
    session_id = "hops-1"
    await quiet.cluster.new_session(session_id)
    stream = quiet.cluster.ledger.subscribe(session_id, 0)
    # The first turn warms up what later turns reuse (the runner's fact
    # cache, its tools, connections); it is not counted.
    await _turn(quiet, stream, session_id, 0, expected, warm_up=True)

    before = hops.snapshot()
    for n in range(1, TURNS + 1):
        await _turn(quiet, stream, session_id, n, expected)
    spent = hops.snapshot().since(before)

    expected_calls = {name: n * TURNS for name, n in expected.calls.items()}
    expected_commits = {name: n * TURNS for name, n in expected.commits.items()}
    observed = _observed(spent, TURNS)
    assert spent.calls == expected_calls, observed
    assert spent.commits == expected_commits, observed
    # Sticky: every turn was answered under the first turn's epoch.
    facts = await quiet.cluster.ledger.read_all(session_id)
    epochs = {f.epoch for f in facts if f.kind == "assistant"}
    assert (epochs == {1}) if sticky_ms else (len(epochs) == TURNS + 1), epochs
