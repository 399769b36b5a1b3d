"""An MCP server over streamable HTTP that is down for a while is used again
once it is back (issue 24, point 8: "and on a closed connection").

A real runner process and the MCP test server over streamable HTTP. The
server is killed; a tool call made while nothing listens on its port fails
as an error result the model sees (the connection is refused), not as a
wedged source; the server is started again on the same port and the next
call of the same session succeeds on a new connection. Both eras of the
protocol: one where the client holds a session (Mcp-Session-Id) and one
without.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from services.common.config import Settings
from services.common.secrets import SecretPolicy
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.mcp_server import HttpMcpServer
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

SESSION = "s-down"


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(params=["session", "sessionless"])
def server_options(request: pytest.FixtureRequest, port: int) -> list[str]:
    era = ["--handshake-only"] if request.param == "session" else []
    return ["--port", str(port), *era]


@pytest.fixture
def servers() -> Iterator[list[HttpMcpServer]]:
    started: list[HttpMcpServer] = []
    yield started
    for each in started:
        each.stop()


@pytest.fixture
async def cluster(sqlite_settings: Settings, port: int) -> AsyncIterator[Cluster]:
    policy = SecretPolicy().with_tool_target(f"http://127.0.0.1:{port}")
    running = await start_cluster(sqlite_settings.with_overrides(secrets=policy))
    try:
        yield running
    finally:
        await stop_cluster(running)


async def echo(cluster: Cluster, text: str, request_id: str) -> dict[str, Any]:
    """The tool result of one input asking the server to echo `text`."""
    await cluster.send(SESSION, f'/tool files.echo {{"text": "{text}"}}', request_id)
    await cluster.settled(SESSION)
    results = [f.data for f in await cluster.facts(SESSION) if f.kind == "tool_result"]
    latest: dict[str, Any] = dict(results[-1])
    return latest


async def test_a_call_while_the_server_is_down_fails_and_the_next_one_after_it_is_back_works(
    cluster: Cluster, servers: list[HttpMcpServer], server_options: list[str]
) -> None:
    servers.append(HttpMcpServer(server_options))
    tool = {"source": "mcp", "name": "files", "transport": "http", "url": servers[0].url}
    await cluster.kernel.put_loadout("default", {"tools": [tool]})
    runner = cluster.start_runner(**cluster.settings.secrets.to_env())
    await cluster.runner_ready(runner)
    await cluster.new_session(SESSION)

    before = await echo(cluster, "before", "d1")
    assert (before["content"], before["isError"]) == ("before", False)

    # Gone, with nothing listening on its port: the connection is refused.
    servers[0].proc.kill()
    servers[0].proc.wait()
    down = await echo(cluster, "while down", "d2")
    assert down["isError"] is True, down

    servers.append(HttpMcpServer(server_options))
    after = await echo(cluster, "after", "d3")
    assert (after["content"], after["isError"]) == ("after", False), after
    # Each input was answered once: the failed call did not park the session.
    facts = await cluster.facts(SESSION)
    assert [f.kind for f in facts].count("tool_result") == 3
