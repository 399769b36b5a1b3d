"""Tools end to end: real runner processes, the offline model, a real MCP
server over stdio (a child process of the runner), a real gRPC ToolService,
and tenants whose loadouts differ.

- Idempotency keys are scoped: two sessions whose first calls get the same
  call id (the offline model derives it from the request) each apply their
  effect.
- A tenant's tools are its own: another tenant cannot call them and its
  model is not offered them; no MCP child is shared, and none starts before
  a session of its tenant needs tools.
- A newer loadout revision, and a drain, close the MCP children they no
  longer need.
"""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from agent_io.tools import idempotency_key
from services.common.config import Settings
from services.common.secrets import SecretPolicy
from services.ledger import CommittedFact
from services.runner.tool_state import counter_store
from tests.support.cluster import Cluster, running_cluster
from tests.support.ledger_invariants import assert_recovered
from tests.support.mcp_server import server_command
from tests.support.polling import eventually
from tests.support.ports import free_port
from tests.support.processes import ChildProcess
from tests.support.tool_fixtures import alive, children_of, command_line
from tests.support.tool_service import RunningToolService, launched
from tests.support.wire_servers import WireServer, data_frame, sse_reply

pytestmark = pytest.mark.slow

COMMAND = list(server_command())
TOOL_TOKEN = "tool-token-for-the-runner-tests"
FILES = {"source": "mcp", "name": "files", "transport": "stdio", "command": COMMAND}


@pytest.fixture
def tool_service(tmp_path: Path) -> Iterator[RunningToolService]:
    with launched(tmp_path / "effects.json", token=TOOL_TOKEN) as service:
        yield service


@pytest.fixture
def wire_port() -> int:
    return free_port()


@pytest.fixture
def policy(tool_service: RunningToolService, wire_port: int) -> SecretPolicy:
    """What the operator allows: the MCP test server for acme and initech,
    the ToolService for acme, and the wire model's origin."""
    return (
        SecretPolicy()
        .with_command(COMMAND, "acme")
        .with_command(COMMAND, "initech")
        .with_tool_target(tool_service.address, "acme")
        .with_origin(f"http://127.0.0.1:{wire_port}")
    )


@pytest.fixture
async def cluster(pg_settings: Settings, policy: SecretPolicy) -> AsyncIterator[Cluster]:
    # The kernel checks loadouts against the operator's policy when written.
    async with running_cluster(pg_settings.with_overrides(secrets=policy)) as running:
        for tenant in ("acme", "globex", "initech"):
            await running.kernel.create_tenant(tenant)
        yield running


async def start_runner(cluster: Cluster, policy: SecretPolicy) -> ChildProcess:
    runner = cluster.start_runner(**policy.to_env(), KEEL_TOOL_TOKEN=TOOL_TOKEN)
    await cluster.runner_ready(runner)
    return runner


async def ask(cluster: Cluster, tenant: str, session_id: str, text: str) -> list[CommittedFact]:
    """One input in a new session of `tenant`, answered; the session's facts."""
    await cluster.new_session(session_id, tenant)
    appended = await cluster.ledger.append_one(
        session_id, "input", {"text": text, "requestId": "r1"}
    )
    await cluster.kernel.enqueue(session_id, tenant, input_seq=appended.seq)
    await cluster.settled(session_id)
    facts = await cluster.facts(session_id)
    assert_recovered(facts)
    return facts


def tool_results(facts: list[CommittedFact]) -> list[Mapping[str, Any]]:
    return [fact.data for fact in facts if fact.kind == "tool_result"]


def only_result(facts: list[CommittedFact]) -> Mapping[str, Any]:
    (result,) = tool_results(facts)
    return result


async def gone(pid: int, what: str) -> None:
    async def probe() -> bool | None:
        return True if not alive(pid) else None

    await eventually(probe, what, deadline_s=30)


async def test_two_sessions_with_the_same_call_id_each_apply_their_effect(
    cluster: Cluster, policy: SecretPolicy
) -> None:
    await start_runner(cluster, policy)
    first = await ask(cluster, "default", "shared-1", '/tool counter {"key": "shared-x"}')
    second = await ask(cluster, "default", "shared-2", '/tool counter {"key": "shared-x"}')
    one, two = only_result(first), only_result(second)
    # The offline model gave both calls the same id; their keys differ.
    assert one["toolCallId"] == two["toolCallId"]
    assert one["idempotencyKey"] == idempotency_key("default", "shared-1", one["toolCallId"])
    assert two["idempotencyKey"] == idempotency_key("default", "shared-2", two["toolCallId"])
    assert (json.loads(one["content"]), json.loads(two["content"])) == (
        {"key": "shared-x", "value": 1},
        {"key": "shared-x", "value": 2},
    )
    counter = counter_store(cluster.settings)
    assert counter.value("shared-x") == 2 and counter.executions("shared-x") == 2


async def test_a_tenants_tools_are_its_own(
    cluster: Cluster, policy: SecretPolicy, tool_service: RunningToolService, wire_port: int
) -> None:
    billing = {"source": "grpc", "name": "billing", "target": tool_service.address}
    await cluster.kernel.put_loadout("acme", {"tools": ["clock", FILES, billing]})
    await cluster.kernel.put_loadout("globex", {"tools": ["clock", "counter"]})
    runner = await start_runner(cluster, policy)

    # Another tenant's session starts nothing, and cannot reach acme's tools.
    facts = await ask(cluster, "globex", "globex-1", '/tool files.echo {"text": "hi"}')
    result = only_result(facts)
    assert result["isError"] and "unknown tool 'files.echo'" in result["content"]
    facts = await ask(cluster, "globex", "globex-2", '/tool billing.echo {"text": "hi"}')
    assert only_result(facts)["isError"]
    assert children_of(runner.pid) == []

    # acme's first session that needs tools starts its server.
    facts = await ask(cluster, "acme", "acme-1", '/tool files.echo {"text": "hi"}')
    result = only_result(facts)
    assert (result["content"], result["isError"]) == ("hi", False)
    assert "Tool files.echo returned: hi" in facts[-1].data["content"][0]["text"]
    (child,) = children_of(runner.pid)
    assert "tests.support.mcp_server" in command_line(child)
    # ... and reaches its gRPC ToolService, with the runner's tool token.
    facts = await ask(cluster, "acme", "acme-2", '/tool billing.echo {"text": "over grpc"}')
    assert only_result(facts)["content"] == "over grpc" and not only_result(facts)["isError"]

    # The model globex's sessions are given is offered globex's tools only.
    async with WireServer("/v1/chat/completions", port=wire_port) as wire:
        model = {"provider": "openai", "name": "gpt-test", "baseUrl": f"{wire.url}/v1"}
        await cluster.kernel.put_loadout("globex", {"model": model, "tools": ["clock", "counter"]})
        wire.queue(sse_reply(text_reply("hello")))
        facts = await ask(cluster, "globex", "globex-3", "which tools do you have?")
        assert facts[-1].data["content"][0]["text"] == "hello"
        (request,) = wire.received
        offered = sorted(tool["function"]["name"] for tool in request.body["tools"])
        assert offered == ["clock", "counter"]


async def test_tenants_never_share_an_mcp_child(cluster: Cluster, policy: SecretPolicy) -> None:
    for tenant in ("acme", "initech"):
        await cluster.kernel.put_loadout(tenant, {"tools": [FILES]})
    runner = await start_runner(cluster, policy)
    pids = {}
    for tenant in ("acme", "initech"):
        facts = await ask(cluster, tenant, f"{tenant}-1", "/tool files.environment {}")
        pids[tenant] = json.loads(only_result(facts)["content"])["pid"]
    assert pids["acme"] != pids["initech"]
    assert sorted(children_of(runner.pid)) == sorted(pids.values())
    # A tenant's second session uses the same child (one per revision).
    facts = await ask(cluster, "acme", "acme-2", "/tool files.environment {}")
    assert json.loads(only_result(facts)["content"])["pid"] == pids["acme"]


async def test_a_new_revision_and_a_drain_close_the_children_left_behind(
    cluster: Cluster, policy: SecretPolicy
) -> None:
    await cluster.kernel.put_loadout("acme", {"tools": [FILES]})
    runner = await start_runner(cluster, policy)
    facts = await ask(cluster, "acme", "acme-1", "/tool files.environment {}")
    old = json.loads(only_result(facts)["content"])["pid"]

    await cluster.kernel.put_loadout("acme", {"tools": [{**FILES, "timeoutMs": 30_000}]})
    facts = await ask(cluster, "acme", "acme-2", "/tool files.environment {}")
    new = json.loads(only_result(facts)["content"])["pid"]
    assert new != old
    await gone(old, "revision 1's MCP child to exit")
    assert children_of(runner.pid) == [new]

    # SIGTERM drains the runner (shutdown), which closes what it started.
    runner.proc.send_signal(signal.SIGTERM)
    await runner.line(lambda text: " drained; exiting" in text)
    await gone(new, "the MCP child to exit with its runner")


def text_reply(*pieces: str) -> list[str]:
    """An OpenAI chat-completions stream answering with text."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-test"}
        return data_frame({**body, "choices": [choice]})

    frames = [chunk({"role": "assistant", "content": ""})]
    frames += [chunk({"content": piece}) for piece in pieces]
    return [*frames, chunk({}, finish="stop"), data_frame("[DONE]")]
