"""Every way a tool call can fail is a result the model sees, and the turn is
answered: a real runner process, an MCP server over stdio (its child), a gRPC
ToolService, and sources whose server is not there at all.

One input makes the offline model call, in one answer: a tool slower than
its source's `timeoutMs`, one whose result is over `maxResultBytes`, one
whose result breaks its own output schema, one whose server exits mid-call,
and tools of an MCP URL and a ToolService target where nothing listens. Each
call gets exactly one `tool_result` with `isError` naming the problem, and
the model answers the input. (That the next call starts a crashed MCP
server again is shown in tests/tools/test_mcp_source.py.)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.common.config import Settings
from services.common.secrets import SecretPolicy
from tests.support.cluster import Cluster, running_cluster
from tests.support.ledger_invariants import assert_recovered
from tests.support.ports import free_port
from tests.support.tool_fixtures import ToolServers, start_tool_servers

pytestmark = pytest.mark.slow

TENANT = "acme"
TOOL_TOKEN = "tool-token-for-the-failure-cases"
LIMIT_BYTES = 1000
TIMEOUT_MS = 1000
# Where nothing listens (reserved now, so no other test takes the ports).
NOWHERE_GRPC = f"127.0.0.1:{free_port()}"
NOWHERE_MCP = f"http://127.0.0.1:{free_port()}/mcp"

# The calls of the one input, and what each result must say.
CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("files.slow", {"seconds": 30}, "no result within"),
    ("files.big", {"bytes": 50_000}, "[result truncated: 50000 bytes, the limit is 1000]"),
    ("files.malformed", {}, "files.malformed"),
    ("files.die", {}, "went away during the call"),
    ("billing.slow", {"seconds": 30}, "timed out"),
    ("billing.big", {"size": 50_000}, "[result truncated"),
    ("billing.boom", {}, "boom"),
    ("gone.echo", {"text": "x"}, "tool source 'gone' is unavailable"),
    ("away.echo", {"text": "x"}, "tool source 'away' is unavailable"),
]


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[ToolServers]:
    running = start_tool_servers(tmp_path, TENANT, TOOL_TOKEN)
    yield running
    running.stop()


def policy(servers: ToolServers) -> SecretPolicy:
    return servers.policy.with_tool_target(NOWHERE_GRPC, TENANT).with_tool_target(
        NOWHERE_MCP.rsplit("/", 1)[0], TENANT
    )


def loadout(servers: ToolServers) -> dict[str, Any]:
    limits = {"timeoutMs": TIMEOUT_MS, "maxResultBytes": LIMIT_BYTES}
    files, billing = servers.loadout()["tools"]
    return {
        "tools": [
            {**files, **limits},
            {**billing, **limits},
            {"source": "grpc", "name": "gone", "target": NOWHERE_GRPC},
            {"source": "mcp", "name": "away", "transport": "http", "url": NOWHERE_MCP},
        ]
    }


@pytest.fixture
async def cluster(pg_settings: Settings, servers: ToolServers) -> AsyncIterator[Cluster]:
    async with running_cluster(
        pg_settings.with_overrides(secrets=policy(servers)), backoff_base_ms=100, max_attempts=3
    ) as running:
        await running.kernel.create_tenant(TENANT)
        await running.kernel.put_loadout(TENANT, loadout(servers))
        yield running


async def test_each_failure_is_an_error_result_and_the_turn_is_answered(
    cluster: Cluster, servers: ToolServers
) -> None:
    session = "tool-failures"
    text = "/tool " + " | ".join(f"{name} {json.dumps(args)}" for name, args, _ in CALLS)
    await cluster.new_session(session, TENANT)
    appended = await cluster.ledger.append_one(session, "input", {"text": text, "requestId": "r1"})
    await cluster.kernel.enqueue(session, TENANT, input_seq=appended.seq)
    runner = cluster.start_runner(
        **policy(servers).to_env(), KEEL_TOOL_TOKEN=TOOL_TOKEN, KEEL_MAX_ATTEMPTS="1"
    )
    await cluster.runner_ready(runner)
    await cluster.settled(session, deadline_s=120)

    facts = await cluster.facts(session)
    assert_recovered(facts)
    [asking] = [f for f in facts if f.kind == "assistant" and f.data.get("toolCalls")]
    names = [call["name"] for call in asking.data["toolCalls"]]
    assert names == [name for name, _, _ in CALLS]
    results = {f.data["toolCallId"]: f.data for f in facts if f.kind == "tool_result"}
    assert len(results) == len(CALLS), "exactly one result per call"
    for call, (name, _, says) in zip(asking.data["toolCalls"], CALLS, strict=True):
        result = results[call["id"]]
        assert result["isError"], (name, result)
        assert says in result["content"], (name, result["content"][:300])
        assert len(result["content"].encode()) < 2 * LIMIT_BYTES + 200, name
    answers = [f for f in facts if f.kind == "assistant" and not f.data.get("toolCalls")]
    assert [a.data.get("inputSeqs") for a in answers] == [[appended.seq]], "the turn is answered"
    assert not any(f.kind in ("attempt_failed", "session_parked") for f in facts)
    assert runner.proc.poll() is None, "the runner never crashed"
