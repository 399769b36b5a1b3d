"""The rollout simulator: the prod overlay's runners and edges rolled while 50 sessions stream.

Every Keel service runs as the rendered manifests say (tests/support/kubelet.py:
the image's entry point, args, env, an IP and emptyDirs per pod), one pod
each for the ledger, kernel and compaction, and as many runners and edges
as the autoscalers' minimum (3 and 2). Then both Deployments roll under the
kubelet's rules — new pod, its readiness probe, the old pod's preStop
(`keel drain --local ...`), SIGTERM, SIGKILL at the grace period — while 50
sessions take `/slow` answers and `counter` tool calls (beside a `sleep`
call, so that drains meet open tool rounds), one SSE client per
session follows its stream through the edge Service (reconnecting with
Last-Event-ID when its edge drains), and inputs keep arriving with request
ids (tests/support/rollout_clients.py).

It proves: every acknowledged input answered, once (0 lost, 0 duplicate
final replies; the ledger invariants of tests/support/ledger_invariants.py); each
client's seqs contiguous across its reconnects; every preStop drain done
within its deadline and no pod SIGKILLed; a `handoffs` row for every
session handed over with work owed, naming old and new runtime, epoch,
in-flight count and loadout revision; and no released session waiting
more than one claim round for its successor: from the release to the
successor's `epoch_started` takes at most the runners' claim wait more
than the slowest start of a newly queued session during the rollout (the
same claim path under the same load; a session left to its lease's TTL or
to the kernel's reconciliation would take seconds more).

What the simulation adds to the manifests: the test's PostgreSQL schema
(KEEL_PG_SCHEMA), and runner concurrency and a tenant admission limit sized
for 50 sessions at once, so that a released session never waits for
capacity (which would be a sizing question, not a handoff's).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import statistics
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernel import KernelClient
from kernel.domain import DEFAULT_LOADOUT
from kernel.registry import HandoffInfo
from services.common.config import Settings
from services.ledger import CommittedFact, LedgerClient
from services.runner.config import RunnerConfig
from tests.support.internal_auth import TEST_TOKEN
from tests.support.kubelet import (
    Deployment,
    Node,
    Pod,
    PodTemplate,
    Termination,
    pod_templates,
)
from tests.support.ledger_invariants import assert_recovered, assert_stream_continuous
from tests.support.manifests import OVERLAYS, Doc, KubectlMissing, kubectl, render
from tests.support.polling import eventually
from tests.support.rollout_clients import EdgeService, SessionClient

pytestmark = pytest.mark.slow

SEED = 13
SESSIONS = 50
API_KEY = "rollout-operator-key-0123456789abcdef"
DEADLINE_S = 90.0
# Sized for SESSIONS busy at once on the runners left claiming mid-rollout.
SIZING = {"KEEL_RUNNER_CONCURRENCY": "20"}
MAX_RUNS = SESSIONS + 14


def prod_manifests() -> list[Doc]:
    try:
        kubectl()
    except KubectlMissing as missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{missing} (CI=true: the rollout simulator must run)")
        pytest.skip(str(missing))
    return render(OVERLAYS / "prod")


def ledger_id(session_id: str) -> str:
    """The ledger's (and kernel's) id of a session of tenant `default`."""
    return f"default:{session_id}"


def edge_url(pod: Pod) -> str:
    return f"http://{pod.address('http')}"


async def runtime_id(pod: Pod) -> str:
    """The runtime id a runner pod printed once it served and claimed."""
    line = await pod.process.line(lambda text: text.startswith("runner ") and "listening" in text)
    return line.split()[1]


def raise_failed(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            task.result()


async def settled(ledger: LedgerClient, kernel: KernelClient, session: str) -> bool | None:
    view = await ledger.get_session(session)
    if view.owed_input_seqs or view.open_tool_calls:
        return None
    lease = await kernel.get_lease(session)
    return True if lease.lease is None and not lease.queued else None


def successor_start(facts: list[CommittedFact], epoch: int) -> CommittedFact | None:
    """The first epoch_started after `epoch` (normally epoch+1's)."""
    return next((f for f in facts if f.kind == "epoch_started" and f.data["epoch"] > epoch), None)


def left_owed(facts: list[CommittedFact], start: CommittedFact, until: int) -> bool:
    """Whether the attempt begun by `start` left work it had taken (inputs up
    to its watermark, tool calls) unanswered before seq `until`."""
    before = [f for f in facts if f.seq < until]
    answered = {s for f in before if f.kind == "assistant" for s in f.data.get("inputSeqs") or ()}
    taken = {f.seq for f in before if f.kind == "input" and f.seq <= start.data["watermark"]}
    calls = {
        c["id"] for f in before if f.kind == "assistant" for c in f.data.get("toolCalls") or ()
    }
    results = {f.data["toolCallId"] for f in before if f.kind == "tool_result"}
    return bool(taken - answered or calls - results)


def check_handoffs(
    rows: list[HandoffInfo],
    facts: dict[str, list[CommittedFact]],
    old_runners: set[str],
    all_runners: set[str],
    revision: int,
) -> dict[tuple[str, int], int]:
    """Checks every row against the ledger, and that every hand-over with
    work owed has its row; returns each successor's epoch_started (session,
    seq) with the time from the release to it (ms)."""
    by_epoch = {(row.session_id, row.epoch): row for row in rows}
    assert len(by_epoch) == len(rows), "two rows for one released epoch"
    gaps = {}
    for row in rows:
        assert row.old_runtime_id in old_runners, row
        assert row.new_runtime_id in all_runners - {row.old_runtime_id}, row
        assert row.in_flight >= 1, row
        session = facts[row.session_id]
        own = [f for f in session if f.kind == "epoch_started" and f.data["epoch"] == row.epoch]
        # Released before its attempt wrote anything: no fact of that epoch.
        assert all(f.data["runtimeId"] == row.old_runtime_id for f in own), row
        if own:
            assert row.loadout_revision == revision, row
        successor = successor_start(session, row.epoch)
        assert successor is not None, f"nobody took over {row}"
        # A successor drained before it wrote anything handed the session
        # on in turn: each epoch between has its own row, linked to the next.
        chain = [row]
        while chain[-1].epoch + 1 < successor.data["epoch"]:
            passed_on = by_epoch.get((row.session_id, chain[-1].epoch + 1))
            assert passed_on is not None, f"epoch {chain[-1].epoch + 1} of {row} unaudited"
            assert passed_on.old_runtime_id == chain[-1].new_runtime_id, (chain, passed_on)
            chain.append(passed_on)
        assert successor.data["runtimeId"] == chain[-1].new_runtime_id, (chain, successor)
        if len(chain) == 1:
            gaps[(row.session_id, successor.seq)] = successor.timestamp_ms - row.at_ms
    same_drain = {(r.old_runtime_id, r.in_flight) for r in rows}
    assert len(same_drain) == len({r.old_runtime_id for r in rows}), same_drain
    for session_id, session in facts.items():
        starts = [f for f in session if f.kind == "epoch_started"]
        for start, after in itertools.pairwise(starts):
            if start.data["runtimeId"] in old_runners and left_owed(session, start, after.seq):
                assert (session_id, start.data["epoch"]) in by_epoch, (
                    f"{session_id}: epoch {start.data['epoch']} handed over unaudited"
                )
    return gaps


def fresh_starts(
    facts: dict[str, list[CommittedFact]], successors: set[tuple[str, int]], window: range
) -> list[int]:
    """Input -> epoch_started (ms) of the attempts started by an input (not
    by a handoff) within `window` (ledger time): one claim round plus an
    attempt's start, under the same load as the handoffs."""
    delays = []
    for session_id, session in facts.items():
        for before, fact in itertools.pairwise(session):
            started = fact.kind == "epoch_started" and before.kind == "input"
            if (
                started
                and (session_id, fact.seq) not in successors
                and before.timestamp_ms in window
            ):
                delays.append(fact.timestamp_ms - before.timestamp_ms)
    return delays


async def start_keel(
    node: Node, templates: dict[str, PodTemplate], settings: Settings, stack: AsyncExitStack
) -> tuple[LedgerClient, KernelClient, int]:
    """One ledger, kernel and compaction pod behind their Services; the
    operator's key and the tenant's loadout (its revision)."""
    for component in ("ledger", "kernel", "compaction"):
        (pod,) = await Deployment(node, templates[component], replicas=1).scale_up()
        node.publish(templates[component].deployment, pod)
    ledger = LedgerClient(node.dns["keel-ledger:7101"], settings)
    stack.push_async_callback(ledger.close)
    kernel = KernelClient(node.dns["keel-kernel:7102"], settings)
    stack.push_async_callback(kernel.close)
    await kernel.create_tenant("default", "Default tenant")
    await kernel.create_api_key("default", API_KEY, admin=True, operator=True)
    loadout = {**DEFAULT_LOADOUT, "maxConcurrentRuns": MAX_RUNS}
    return ledger, kernel, await kernel.put_loadout("default", loadout)


async def quiesce(
    clients: list[SessionClient], ledger: LedgerClient, kernel: KernelClient
) -> dict[str, list[CommittedFact]]:
    """Waits until every input is answered on its stream, every session is
    settled, and every stream has caught up with the ledger; the facts by
    ledger id."""
    for client in clients:
        await client.until_answered()
    facts = {}
    for client in clients:
        lid = ledger_id(client.session_id)
        await eventually(partial(settled, ledger, kernel, lid), f"{lid} settled", DEADLINE_S)
        facts[lid] = session = await ledger.read_all(lid)

        async def caught_up(
            client: SessionClient = client, head: int = session[-1].seq
        ) -> bool | None:
            return True if client.last_seq >= head else None

        await eventually(caught_up, f"{client.session_id}'s stream at the head", DEADLINE_S)
    return facts


def check_sessions(clients: list[SessionClient], facts: dict[str, list[CommittedFact]]) -> None:
    """Nothing lost, nothing doubled, every stream continuous."""
    for client in clients:
        session = facts[ledger_id(client.session_id)]
        assert_recovered(session)
        inputs = {f.data["requestId"]: f.seq for f in session if f.kind == "input"}
        assert inputs == client.acked, f"{client.session_id}: inputs lost or doubled"
        assert_stream_continuous(client.seqs)
        assert client.seqs == [f.seq for f in session], client.session_id
        assert client.drains >= 1, f"{client.session_id} never met a draining edge"


async def test_rolling_runners_and_edges_under_load_loses_and_doubles_nothing(
    pg_settings: Settings, tmp_path: Path
) -> None:
    began = time.monotonic()
    docs = prod_manifests()
    templates = pod_templates(docs)
    secrets = {"keel-db": {"url": pg_settings.database_url}, "keel-internal": {"token": TEST_TOKEN}}
    node = Node(
        docs, tmp_path / "node", secrets, {"KEEL_PG_SCHEMA": pg_settings.pg_schema, **SIZING}
    )
    service = EdgeService()
    runners = Deployment(node, templates["runner"])
    edges = Deployment(
        node,
        templates["edge"],
        on_ready=lambda pod: service.add(edge_url(pod)),
        on_deleted=lambda pod: service.remove(edge_url(pod)),
    )
    tasks: list[asyncio.Future[Any]] = []
    async with AsyncExitStack() as stack:
        stack.callback(node.kill_all)
        ledger, kernel, revision = await start_keel(node, templates, pg_settings, stack)
        await asyncio.gather(runners.scale_up(), edges.scale_up())
        assert (len(runners.pods), len(edges.pods)) == (3, 2), "the prod autoscalers' minimum"
        old_runners = {await runtime_id(pod) for pod in runners.pods}
        http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=30.0,
            limits=httpx.Limits(max_connections=4 * SESSIONS, max_keepalive_connections=SESSIONS),
        )
        stack.push_async_callback(http.aclose)
        # Run first on the way out: the clients stop before their connections close.
        stack.push_async_callback(stop_all, tasks, runners, edges)
        clients = []
        for index in range(SESSIONS):
            session_id = f"s-{index:02d}"
            created = await http.post(f"{service.pick()}/v1/sessions", json={"id": session_id})
            assert created.status_code == 201, created.text
            rng = random.Random(f"{SEED}-{index}")
            clients.append(SessionClient(session_id, service, http, rng))
        stop = asyncio.Event()
        tasks += [asyncio.create_task(c.follow(), name=f"sse-{c.session_id}") for c in clients]
        writers = [asyncio.create_task(c.write(stop), name=f"in-{c.session_id}") for c in clients]
        tasks += writers

        async def warm() -> bool | None:
            raise_failed(tasks)
            return True if all(c.answered for c in clients) else None

        await eventually(warm, "an answer in every session", DEADLINE_S)
        ready_s = time.monotonic() - began

        # `kubectl apply` of a new image: both Deployments roll at once.
        rolling, rolled_from = time.monotonic(), time.time_ns() // 1_000_000
        rolls = [asyncio.ensure_future(d.roll()) for d in (runners, edges)]
        tasks += rolls
        while not all(r.done() for r in rolls):
            running = [t for t in tasks if not t.done()]
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            raise_failed(tasks)
        stops = [stopped for r in rolls for stopped in r.result()]
        roll_s = time.monotonic() - rolling
        window = range(rolled_from, time.time_ns() // 1_000_000)
        new_runners = {await runtime_id(pod) for pod in runners.pods}

        stop.set()
        await asyncio.wait_for(asyncio.gather(*writers), DEADLINE_S)
        facts = await quiesce(clients, ledger, kernel)
        raise_failed(tasks)
        rows = await kernel.list_handoffs(limit=1000)

        check_sessions(clients, facts)
        # Every old pod drained by its preStop in time, none SIGKILLed.
        for stopped in stops:
            assert stopped.pre_stop_code == 0 and not stopped.killed, stopped
        assert rows, "a rollout under load hands sessions over"
        all_runners = old_runners | new_runners
        gaps = check_handoffs(rows, facts, old_runners, all_runners, revision)
        baseline = fresh_starts(facts, set(gaps), window)
        report(clients, list(gaps.values()), baseline, stops, (ready_s, roll_s, began))
        # A released session is queued like a new input and taken by the
        # claim under way, or at the latest by the next one: no later than
        # the slowest start of a new input meanwhile, plus one claim wait.
        claim_wait_ms = RunnerConfig.from_env("", "", runners.pods[0].env).claim_wait_ms
        bound = claim_wait_ms + max(baseline)
        late = {where: gap for where, gap in gaps.items() if gap > bound}
        assert not late, f"successors later than one claim round ({bound} ms): {late}"


async def stop_all(tasks: list[asyncio.Future[Any]], *deployments: Deployment) -> None:
    """Clients and rollouts first, then any termination still under way."""
    pending = [*tasks, *(t for d in deployments for t in d.terminating)]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def report(
    clients: list[SessionClient],
    gaps: list[int],
    baseline: list[int],
    stops: list[Termination],
    times: tuple[float, float, float],
) -> None:
    """The figures of the run (shown with `pytest -s`)."""
    ready_s, roll_s, began = times
    reconnects = [c.reconnects for c in clients]

    def spread(values: list[int]) -> str:
        return f"{min(values)}/{statistics.median(values):.0f}/{max(values)}"

    print(
        f"\nrollout: {sum(len(c.acked) for c in clients)} inputs, "
        f"{sum(c.retries for c in clients)} POSTs retried after a failure, "
        f"{sum(c.resends for c in clients)} sent twice on purpose; {len(gaps)} handoffs, "
        f"release->successor ms min/median/max {spread(gaps)}, input->new attempt "
        f"{spread(baseline)} ({len(baseline)}); SSE drains {sum(c.drains for c in clients)}, "
        f"reconnects {sum(reconnects)} (max {max(reconnects)} per client); "
        f"ready {ready_s:.1f}s, roll {roll_s:.1f}s, total {time.monotonic() - began:.1f}s"
    )
    for stop in stops:
        print(
            f"  {stop.pod} deleted at +{stop.began - began:.1f}s: preStop {stop.pre_stop_code} "
            f"in {stop.pre_stop_s:.2f}s, exited in preStop {stop.exited_in_pre_stop}, "
            f"exit {stop.exit_code}, {stop.seconds:.2f}s; {stop.pre_stop_output.strip()}"
        )
