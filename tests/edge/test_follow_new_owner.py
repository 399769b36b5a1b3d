"""The live stream follows a takeover at once, even when the old owner is
frozen rather than dead (SPEC §2, §9).

Runner A (a real process) streams a slow answer and is SIGSTOPped in the
middle of it. Its connection to the kernel stays open, so its lease expires
only at the TTL (a short `KEEL_LEASE_MS` here); runner B, a second process,
then claims, commits `epoch_started` and streams its own answer. A client
must get B's deltas while A is still frozen: A is resumed only once the
client has one (or the test fails at its deadline), and whatever A still
tries then is fenced off. No delta of A's epoch may reach a client after it
was sent B's `epoch_started`.

The first test goes through the edge's HTTP API. The other two drive a
fan-out of their own over the same ledger, kernel and runners, with the
ledger's answers timed around the takeover (tests/support/frozen_owner.py):
a stream that starts while A is frozen, whose subscription head already
includes B's `epoch_started`; and a client whose backlog shows it the
takeover while the fan-out still relays A's last deltas.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable

import pytest

from edge.fanout import FanoutHub, Live
from services.cli.chat_view import SseEvent
from services.common.config import Settings
from services.ledger import CommittedFact, LedgerClient
from services.runner.client import RunnerClient
from services.runner.hub import Partial
from tests.support.edge_stack import Stack
from tests.support.frozen_owner import (
    Follower,
    Frozen,
    HeadAfterTakeover,
    NewEpochHeldBack,
    epoch_started_after,
)
from tests.support.processes import ChildProcess
from tests.support.sse import SseReader, fact_seqs, parse

# Starts `keel up` or service processes: the whole suite, not `make check`.
pytestmark = pytest.mark.slow

# Short enough that a frozen owner's lease expires within the test, long
# enough that a busy machine does not expire a live owner's.
LEASE_MS = 1500
# How long anything the test waits for may take (a deadline, not a timing).
DEADLINE_S = 60.0
WORDS = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
SLOW_ANSWER = f"/slow 3 {WORDS}"


@pytest.fixture
def pg_settings(pg_settings: Settings) -> Settings:
    # The kernel, the edge and the runner processes share these settings.
    return pg_settings.with_overrides(lease_ms=LEASE_MS)


@pytest.fixture
async def runners(stack: Stack) -> AsyncIterator[list[ChildProcess]]:
    """Runner processes a test starts; each is resumed (if stopped) and killed."""
    started: list[ChildProcess] = []
    yield started
    for runner in started:
        if runner.proc.poll() is None:
            os.kill(runner.pid, signal.SIGCONT)
        runner.kill()


async def start_runner(stack: Stack, runners: list[ChildProcess]) -> ChildProcess:
    runner = stack.cluster.start_runner()
    runners.append(runner)
    await stack.cluster.runner_ready(runner)
    return runner


async def answering_on_first(
    stack: Stack, runners: list[ChildProcess], session: str
) -> tuple[ChildProcess, int]:
    """Runner A, alone, takes the slow answer; (A, its epoch)."""
    first = await start_runner(stack, runners)
    posted = await stack.post_input(session, SLOW_ANSWER, "slow-1")
    assert posted.status_code == 202, posted.text
    started = await epoch_started_after(
        stack.cluster.ledger, stack.ledger_id(session), 0, DEADLINE_S
    )
    return first, started.epoch


async def fenced(runner: ChildProcess) -> None:
    """The resumed owner found its lease taken and stopped; if it got as far
    as a write, the ledger refused it (STALE_EPOCH) and it says "fenced"."""
    await runner.line(lambda line: "fenced" in line or " lost" in line, DEADLINE_S)


def fan_out(stack: Stack, ledger: LedgerClient) -> FanoutHub:
    """A fan-out over `ledger` that finds runners as the edge does."""
    gateway = stack.gateway

    async def owner_of(session_id: str) -> RunnerClient | None:
        owner = await gateway.owner(session_id)
        return await gateway.runner(owner) if owner else None

    return FanoutHub(ledger, owner_of, gateway.runner)


# ---------------------------------------------------------------- checks


def check_fenced(facts: list[CommittedFact], old_epoch: int, new_epoch: int) -> None:
    """Nothing of the frozen owner was accepted after the takeover."""
    takeover = next(f.seq for f in facts if f.kind == "epoch_started" and f.epoch == new_epoch)
    late = [f for f in facts if f.seq > takeover and f.epoch == old_epoch]
    assert not late, f"the frozen owner's writes were accepted: {late}"
    answers = [f for f in facts if f.kind == "assistant"]
    assert len(answers) == 1 and answers[0].epoch == new_epoch, answers


def is_delta(epoch: int) -> Callable[[Live], bool]:
    return lambda item: isinstance(item, Partial) and item.epoch == epoch


def is_started(epoch: int) -> Callable[[Live], bool]:
    return lambda item: (
        isinstance(item, CommittedFact) and item.kind == "epoch_started" and item.epoch == epoch
    )


def is_answer(item: Live) -> bool:
    return isinstance(item, CommittedFact) and item.kind == "assistant"


def check_followed(items: list[Live], facts: list[CommittedFact], new_epoch: int) -> None:
    """Every fact once, in order; after the successor's epoch_started only
    its own deltas, and its answer previewed in full."""
    seqs = [item.seq for item in items if isinstance(item, CommittedFact)]
    answer = next(f.seq for f in facts if f.kind == "assistant")
    assert seqs == list(range(1, answer + 1)), "a gap or a repeat in the stream"
    takeover = next(i for i, item in enumerate(items) if is_started(new_epoch)(item))
    after = [item for item in items[takeover:] if isinstance(item, Partial)]
    assert after and all(p.epoch == new_epoch for p in after), after
    assert "fourteen" in "".join(p.text for p in after if p.channel == "text")


# ---------------------------------------------------------------- tests


async def test_a_client_sees_the_successors_deltas_while_the_old_owner_is_frozen(
    stack: Stack, runners: list[ChildProcess]
) -> None:
    session = await stack.new_session()
    events: list[SseEvent] = []
    async with SseReader(stack.http, session) as sse:
        first, old_epoch = await answering_on_first(stack, runners, session)
        frozen = Frozen(first)
        try:
            await sse.until(sse_delta(old_epoch), DEADLINE_S, events)
            await start_runner(stack, runners)  # B, idle: two runners, one session
            frozen.stop()
            takeover = await sse.until(
                lambda e: e.event == "epoch_started" and parse(e)["epoch"] > old_epoch,
                DEADLINE_S,
                events,
            )
            new_epoch = parse(takeover)["epoch"]
            # A stays frozen until the client has a delta of B's epoch.
            await sse.until(sse_delta(new_epoch), DEADLINE_S, events)
        finally:
            frozen.resume()
        await sse.until(lambda e: e.event == "assistant", DEADLINE_S, events)
    await fenced(first)

    await stack.cluster.settled(stack.ledger_id(session), DEADLINE_S)
    facts = await stack.facts(session)
    check_fenced(facts, old_epoch, new_epoch)
    seqs = fact_seqs(events)
    assert seqs == list(range(1, facts[-1].seq + 1)), "a gap or a repeat in the stream"
    takeover_at = events.index(takeover)
    after = [parse(e) for e in events[takeover_at:] if e.event == "delta"]
    assert after and all(d["epoch"] == new_epoch for d in after), after
    assert "fourteen" in "".join(d["text"] for d in after if d["channel"] == "text")


def sse_delta(epoch: int) -> Callable[[SseEvent], bool]:
    return lambda event: event.event == "delta" and parse(event)["epoch"] == epoch


async def test_a_stream_opened_as_the_owner_is_taken_over_follows_the_successor(
    stack: Stack, runners: list[ChildProcess]
) -> None:
    """The stream opens while A is frozen; its subscription starts after B's
    epoch_started (forced here), so that fact never comes live: the owner
    must be looked up after the head is fixed, or A is followed for good."""
    session = await stack.new_session()
    ledger_id = stack.ledger_id(session)
    first, old_epoch = await answering_on_first(stack, runners, session)
    await start_runner(stack, runners)
    frozen = Frozen(first)
    settings = stack.cluster.settings
    ledger = HeadAfterTakeover(stack.cluster.ledger_server.target, settings, old_epoch, DEADLINE_S)
    client: Follower | None = None
    try:
        frozen.stop()
        client = Follower(fan_out(stack, ledger), ledger_id)
        takeover = await epoch_started_after(stack.cluster.ledger, ledger_id, old_epoch, DEADLINE_S)
        await client.until(is_delta(takeover.epoch), "a delta of the new epoch", DEADLINE_S)
        frozen.resume()
        await client.until(is_answer, "the answer", DEADLINE_S)
    finally:
        frozen.resume()
        if client is not None:
            await client.close()
        await ledger.close()
    await fenced(first)

    await stack.cluster.settled(ledger_id, DEADLINE_S)
    facts = await stack.facts(session)
    check_fenced(facts, old_epoch, takeover.epoch)
    check_followed(client.items, facts, takeover.epoch)


async def test_a_late_delta_of_the_old_owner_is_not_shown_after_the_takeover(
    stack: Stack, runners: list[ChildProcess]
) -> None:
    """The fan-out follows A, and hears of B's epoch_started late (forced
    here); a client that joined after the takeover has it from its backlog.
    Resumed, A streams on until it learns its lease is gone, and the fan-out
    relays that: the first client may see it (it precedes the takeover in
    its stream), the later one must not."""
    session = await stack.new_session()
    ledger_id = stack.ledger_id(session)
    settings = stack.cluster.settings
    ledger = NewEpochHeldBack(stack.cluster.ledger_server.target, settings, 1)
    hub = fan_out(stack, ledger)
    early = Follower(hub, ledger_id)
    late: Follower | None = None
    first: ChildProcess | None = None
    frozen: Frozen | None = None
    try:
        first, old_epoch = await answering_on_first(stack, runners, session)
        assert old_epoch == 1
        frozen = Frozen(first)
        await early.until(is_delta(old_epoch), "a delta of A's epoch", DEADLINE_S)
        await start_runner(stack, runners)
        frozen.stop()
        takeover = await epoch_started_after(stack.cluster.ledger, ledger_id, old_epoch, DEADLINE_S)
        late = Follower(hub, ledger_id)
        await late.until(is_started(takeover.epoch), "the takeover in the backlog", DEADLINE_S)
        relayed = sum(1 for item in early.items if is_delta(old_epoch)(item))
        frozen.resume()
        await early.until(
            lambda _: sum(1 for item in early.items if is_delta(old_epoch)(item)) > relayed,
            "A's deltas after it was resumed",
            DEADLINE_S,
        )
        ledger.release.set()
        for client in (early, late):
            await client.until(is_answer, "the answer", DEADLINE_S)
    finally:
        if frozen is not None:
            frozen.resume()
        await early.close()
        if late is not None:
            await late.close()
        await ledger.close()
    assert first is not None
    await fenced(first)

    await stack.cluster.settled(ledger_id, DEADLINE_S)
    facts = await stack.facts(session)
    check_fenced(facts, old_epoch, takeover.epoch)
    for client in (early, late):
        check_followed(client.items, facts, takeover.epoch)
