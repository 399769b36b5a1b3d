"""The crash matrix for tools of a tenant's loadout: an MCP server over
stdio and a gRPC ToolService, both honouring the idempotency key.

A real runner freezes at a commit point of a tool round (KEEL_FAULT_POINT)
and is SIGKILLed there; a successor with a higher epoch finishes the turn.
Whatever the point, each call has exactly one `tool_result`, and the
server applied each effect once:

- `mid_tool`: the call ran but its result was not committed. The successor
  calls again with the same idempotency key (the server's own log shows it
  twice), the server executes it a second time and does not apply it again.
- `after_assistant_commit`: the call was committed but never ran; the
  successor runs it, once.
- `after_some_tool_results`: of two calls, the first ran and its result was
  committed; the successor runs only the second.

The MCP server is a child process of the runner. When the runner is
SIGKILLed, the child reads EOF on its stdin and exits (no orphan is left
running), and the successor starts a child of its own.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent_io.tools import idempotency_key
from services.common.config import Settings
from services.ledger import CommittedFact
from tests.support.cluster import Cluster, running_cluster
from tests.support.ledger_invariants import assert_handed_over, assert_recovered
from tests.support.polling import eventually
from tests.support.processes import ChildProcess
from tests.support.tool_fixtures import (
    MCP_SOURCE,
    SOURCES,
    ToolServers,
    alive,
    mcp_children_of,
    start_tool_servers,
)

pytestmark = pytest.mark.slow

TENANT = "acme"
TOOL_TOKEN = "tool-token-for-the-crash-matrix"


@dataclass(frozen=True)
class Row:
    """One commit point of a tool round, and what must follow from a kill there."""

    fault: str
    # The `apply` keys of the `/tool` command, one call each.
    keys: tuple[str, ...]
    # Per key: executions by the killed runner, then by its successor.
    executed_by: tuple[tuple[int, int], ...]


ROWS = {
    "mid_tool": Row("mid_tool", ("K",), ((1, 1),)),
    "after_assistant_commit": Row("after_assistant_commit", ("K",), ((0, 1),)),
    "after_some_tool_results": Row("after_some_tool_results", ("K-a", "K-b"), ((1, 0), (0, 1))),
}


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[ToolServers]:
    running = start_tool_servers(tmp_path, TENANT, TOOL_TOKEN)
    yield running
    running.stop()


@pytest.fixture
async def cluster(pg_settings: Settings, servers: ToolServers) -> AsyncIterator[Cluster]:
    # The kernel checks the loadout against the operator's policy when written.
    async with running_cluster(
        pg_settings.with_overrides(secrets=servers.policy), backoff_base_ms=100, max_attempts=3
    ) as running:
        await running.kernel.create_tenant(TENANT)
        await running.kernel.put_loadout(TENANT, servers.loadout())
        yield running


def tool_command(source: str, keys: tuple[str, ...]) -> str:
    """The offline model's `/tool a {...} | b {...}`: one call per key, in order."""
    calls = [f"{source}.apply {json.dumps({'key': key})}" for key in keys]
    return "/tool " + " | ".join(calls)


async def send(cluster: Cluster, session_id: str, text: str) -> int:
    await cluster.new_session(session_id, TENANT)
    appended = await cluster.ledger.append_one(
        session_id, "input", {"text": text, "requestId": "r1"}
    )
    await cluster.kernel.enqueue(session_id, TENANT, input_seq=appended.seq)
    return appended.seq


async def runtime_id(runner: ChildProcess) -> str:
    """The runner's id, from the line it prints once it serves."""
    line = await runner.line(lambda text: text.startswith("runner ") and " listening on " in text)
    return line.split()[1]


async def frozen_at(cluster: Cluster, servers: ToolServers, fault: str) -> ChildProcess:
    """A runner that has reached `fault` and stopped there, not yet killed."""
    runner = cluster.start_runner(**servers.runner_env(), KEEL_FAULT_POINT=fault)
    await runner.line(lambda line: line == f"FAULT {fault.partition('@')[0]}", deadline_s=60)
    return runner


async def logged(servers: ToolServers, source: str, count: int) -> list[str]:
    """The keys the server logged, once it has logged `count` executions:
    the ToolService's stderr reaches the test through a reader thread."""

    async def probe() -> list[str] | None:
        keys = servers.logged_keys(source)
        return keys if len(keys) >= count else None

    return await eventually(probe, f"{count} executions in the {source} server's log", 30)


def calls_of(facts: list[CommittedFact]) -> list[dict[str, object]]:
    return [dict(c) for f in facts if f.kind == "assistant" for c in f.data.get("toolCalls") or ()]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("row", ROWS.values(), ids=list(ROWS))
async def test_a_successor_applies_each_tool_effect_once(
    cluster: Cluster, servers: ToolServers, row: Row, source: str
) -> None:
    session = f"tools-{source}-{row.fault.replace('_', '-')}"
    input_seq = await send(cluster, session, tool_command(source, row.keys))

    doomed = await frozen_at(cluster, servers, row.fault)
    doomed_id = await runtime_id(doomed)
    before = Counter(await logged(servers, source, sum(runs for runs, _ in row.executed_by)))
    doomed.kill()

    successor = cluster.start_runner(**servers.runner_env())
    successor_id = await runtime_id(successor)
    await cluster.settled(session, deadline_s=60)

    facts = await cluster.facts(session)
    assert_recovered(facts)
    old_epoch = assert_handed_over(facts, doomed_id, successor_id)
    answers = [f for f in facts if f.kind == "assistant" and f.data.get("inputSeqs")]
    assert [a.data["inputSeqs"] for a in answers] == [[input_seq]]
    assert answers[0].epoch == old_epoch + 1, "the successor answered the turn"

    calls = calls_of(facts)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (f"{source}.apply", {"key": key}) for key in row.keys
    ]
    results = {f.data["toolCallId"]: f for f in facts if f.kind == "tool_result"}
    per_call = Counter(f.data["toolCallId"] for f in facts if f.kind == "tool_result")
    assert per_call == Counter(c["id"] for c in calls), "exactly one tool_result per call id"
    expected_runs = sum(
        doomed_runs + successor_runs for doomed_runs, successor_runs in row.executed_by
    )
    keys_logged = Counter(await logged(servers, source, expected_runs))
    for call, key, (doomed_runs, successor_runs) in zip(
        calls, row.keys, row.executed_by, strict=True
    ):
        result = results[str(call["id"])]
        idem = idempotency_key(TENANT, session, str(call["id"]))
        # Every attempt of the call carries the same key, scoped to the session.
        assert result.data["idempotencyKey"] == idem
        assert not result.data["isError"], result.data["content"]
        assert before[idem] == doomed_runs, f"{key}: runs before the kill"
        assert keys_logged[idem] == doomed_runs + successor_runs, f"{key}: runs in all"
        assert servers.times_applied(source, idem, key) == 1, f"{key}: applied more than once"
        # The result is committed by whoever ran the call last.
        assert result.epoch == (old_epoch + 1 if successor_runs else old_epoch), key
    if row.fault == "mid_tool":
        # The successor's call was a repeat, and the server said so.
        (result,) = results.values()
        already = "already applied" if source == MCP_SOURCE else '"applied": false'
        assert already in result.data["content"], result.data["content"]
    assert set(keys_logged) == {idempotency_key(TENANT, session, str(c["id"])) for c in calls}


async def test_the_mcp_child_of_a_killed_runner_exits_and_the_successor_starts_its_own(
    cluster: Cluster, servers: ToolServers
) -> None:
    session = "tools-orphaned-child"
    await send(cluster, session, tool_command(MCP_SOURCE, ("K",)))
    doomed = await frozen_at(cluster, servers, "mid_tool")
    doomed_id = await runtime_id(doomed)
    (orphan,) = mcp_children_of(doomed.pid)

    doomed.kill()

    # Nothing signals the child: its stdin pipe has no writer left, and the
    # SDK's stdio server ends at EOF on its input. A child that outlived its
    # runner would be reparented and keep running until this deadline.
    async def exited() -> bool | None:
        return None if alive(orphan) else True

    await eventually(exited, f"the killed runner's MCP child {orphan} to exit", 30)

    successor = cluster.start_runner(**servers.runner_env())
    successor_id = await runtime_id(successor)
    await cluster.settled(session, deadline_s=60)
    facts = await cluster.facts(session)
    assert_recovered(facts)
    assert_handed_over(facts, doomed_id, successor_id)
    (own,) = mcp_children_of(successor.pid)
    assert own != orphan
    (call,) = calls_of(facts)
    idem = idempotency_key(TENANT, session, str(call["id"]))
    # The orphan ran the call once; the successor's own child ran it again.
    assert servers.logged_keys(MCP_SOURCE) == [idem, idem]
    assert servers.times_applied(MCP_SOURCE, idem, "K") == 1
