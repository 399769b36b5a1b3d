"""An MCP server over streamable HTTP restarted mid-session is used again
(issue 24, point 8).

A real runner process, the offline model, and the MCP test server over
streamable HTTP speaking the handshake era of the protocol (as most servers
in use do): the runner's client holds a session (Mcp-Session-Id) that the
server forgets when it restarts, and answers 404 for (or 400, as servers
built on the TypeScript SDK do). The server is killed
and started again on the same port between two inputs of one session; the
second tool call succeeds on a new session, as the spec asks of a client.
A server that is down for a while (nothing listens on its port: the
connection is refused) fails the calls made meanwhile, as error results the
model sees, and is used again once it is back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from services.common.config import Settings
from services.common.secrets import SecretPolicy
from tests.support.cluster import Cluster, running_cluster
from tests.support.mcp_server import HttpMcpServer
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

SESSION = "s-restart"


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(params=["404", "400"])
def server_options(request: pytest.FixtureRequest, port: int) -> list[str]:
    """The spec's 404 for a session the server does not know, or the 400
    servers built on the TypeScript SDK answer."""
    status_400 = ["--unknown-session-400"] if request.param == "400" else []
    return ["--port", str(port), "--handshake-only", *status_400]


@pytest.fixture
def server(server_options: list[str]) -> Iterator[list[HttpMcpServer]]:
    """The running server, last started first (the test replaces it)."""
    running = [HttpMcpServer(server_options)]
    yield running
    for each in running:
        each.stop()


@pytest.fixture
async def cluster(sqlite_settings: Settings, port: int) -> AsyncIterator[Cluster]:
    policy = SecretPolicy().with_tool_target(f"http://127.0.0.1:{port}")
    async with running_cluster(sqlite_settings.with_overrides(secrets=policy)) as running:
        yield running


async def echo(cluster: Cluster, text: str, request_id: str) -> dict[str, Any]:
    """The tool result of one input asking the server to echo `text`."""
    await cluster.send(SESSION, f'/tool files.echo {{"text": "{text}"}}', request_id)
    await cluster.settled(SESSION)
    results = [f.data for f in await cluster.facts(SESSION) if f.kind == "tool_result"]
    latest: dict[str, Any] = dict(results[-1])
    return latest


async def test_a_restarted_http_server_is_used_again_in_the_same_session(
    cluster: Cluster, server: list[HttpMcpServer], server_options: list[str]
) -> None:
    tool = {"source": "mcp", "name": "files", "transport": "http", "url": server[0].url}
    await cluster.kernel.put_loadout("default", {"tools": [tool]})
    policy = cluster.settings.secrets
    runner = cluster.start_runner(**policy.to_env())
    await cluster.runner_ready(runner)
    await cluster.new_session(SESSION)

    before = await echo(cluster, "before the restart", "r1")
    assert (before["content"], before["isError"]) == ("before the restart", False)

    # Killed (no goodbye to its clients), and a new process on the same port.
    server[0].proc.kill()
    server[0].proc.wait()
    server.insert(0, HttpMcpServer(server_options))

    after = await echo(cluster, "after the restart", "r2")
    assert (after["content"], after["isError"]) == ("after the restart", False), after


async def test_a_call_while_the_server_is_down_fails_and_the_next_one_after_it_is_back_works(
    cluster: Cluster, server: list[HttpMcpServer], server_options: list[str]
) -> None:
    tool = {"source": "mcp", "name": "files", "transport": "http", "url": server[0].url}
    await cluster.kernel.put_loadout("default", {"tools": [tool]})
    runner = cluster.start_runner(**cluster.settings.secrets.to_env())
    await cluster.runner_ready(runner)
    await cluster.new_session(SESSION)

    before = await echo(cluster, "before", "d1")
    assert (before["content"], before["isError"]) == ("before", False)

    # Gone, with nothing listening on its port: the connection is refused.
    server[0].proc.kill()
    server[0].proc.wait()
    down = await echo(cluster, "while down", "d2")
    assert down["isError"] is True, down

    server.insert(0, HttpMcpServer(server_options))
    after = await echo(cluster, "after", "d3")
    assert (after["content"], after["isError"]) == ("after", False), after
    # Each input was answered once: the failed call did not park the session.
    facts = await cluster.facts(SESSION)
    assert [f.kind for f in facts].count("tool_result") == 3
