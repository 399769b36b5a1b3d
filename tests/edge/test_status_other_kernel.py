"""Two nodes over one PostgreSQL: each a kernel and an edge; node A also runs
a runner, which advertises an address only node A can dial (here: a port
nothing listens on). Asked through node B's edge, `GET /v1/runtime/status`
and `keel status` list node A's live runner as attached to another kernel
(not unreachable: another kernel holds its stream and beats for it) and
list both edges, each registered with its own kernel as runners are.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from edge.gateway import EdgeConfig
from edge.server import EdgeServer
from kernel import KernelClient, KernelServer
from services.common.config import Settings
from services.ledger import LedgerServer
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer
from tests.support.keel_up import keel_cli
from tests.support.polling import eventually
from tests.support.ports import free_port

OPERATOR = "two-nodes-operator-key-0123456789"
DEADLINE_S = 30.0


@dataclass
class Node:
    kernel: KernelServer
    edge: EdgeServer


@dataclass
class TwoNodes:
    a: Node
    b: Node
    runner: RunnerServer


@contextlib.asynccontextmanager
async def two_nodes(settings: Settings) -> AsyncIterator[TwoNodes]:
    stack = contextlib.AsyncExitStack()
    async with stack:
        ledger = await LedgerServer(settings).start()
        stack.push_async_callback(ledger.stop, 0.5)
        nodes: list[Node] = []
        for _ in "ab":
            kernel = await KernelServer(settings, ledger_target=ledger.target).start()
            stack.push_async_callback(kernel.stop, 0.5)
            edge = await EdgeServer(settings, EdgeConfig(ledger.target, kernel.target)).start()
            stack.push_async_callback(edge.stop)
            nodes.append(Node(kernel, edge))
        async with KernelClient(nodes[0].kernel.target, settings) as admin:
            await admin.create_tenant("ops")
            await admin.create_api_key("ops", OPERATOR, admin=True, operator=True)
        # Node A's address, which node B cannot dial: nothing listens there.
        private = f"127.0.0.1:{free_port()}"
        config = RunnerConfig(ledger.target, nodes[0].kernel.target, advertise_address=private)
        runner = await RunnerServer(settings, config).start()
        stack.push_async_callback(runner.stop, 0.2)
        yield TwoNodes(nodes[0], nodes[1], runner)


async def status_of(edge: EdgeServer) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {OPERATOR}"}
    async with httpx.AsyncClient(base_url=edge.url, headers=headers, timeout=DEADLINE_S) as http:
        response = await http.get("/v1/runtime/status")
    assert response.status_code == 200, response.text
    report: dict[str, Any] = response.json()
    return report


def edge_id(edge: EdgeServer) -> str:
    assert edge.gateway is not None
    return edge.gateway.edge_id


async def test_node_b_lists_node_a_s_runner_as_attached_elsewhere_and_both_edges(
    pg_settings: Settings,
) -> None:
    async with two_nodes(pg_settings) as nodes:
        runner_id = nodes.runner.runtime_id
        edge_a, edge_b = edge_id(nodes.a.edge), edge_id(nodes.b.edge)

        async def both_edges_listed() -> dict[str, Any] | None:
            report = await status_of(nodes.b.edge)
            listed = {r["runtimeId"]: r for r in report["runtimes"]}
            return listed if {runner_id, edge_a, edge_b} <= listed.keys() else None

        listed = await eventually(both_edges_listed, "both edges in node B's status", DEADLINE_S)
        runner = listed[runner_id]
        assert (runner["role"], runner["attached"]) == ("runner", True)
        assert runner["liveness"] == "attached to another kernel", runner
        assert (listed[edge_b]["role"], listed[edge_b]["liveness"]) == ("edge", "live")
        assert listed[edge_a]["role"] == "edge"
        assert listed[edge_a]["liveness"] == "attached to another kernel"

        # Node A's own kernel holds the runner's stream: there it is unreachable.
        on_a = {r["runtimeId"]: r for r in (await status_of(nodes.a.edge))["runtimes"]}
        assert on_a[runner_id]["liveness"] == "unreachable"
        assert on_a[edge_b]["liveness"] == "attached to another kernel"

        # What an operator reads from `keel status` against node B.
        shown = await keel_cli(
            "status", "--url", nodes.b.edge.url, "--key", OPERATOR, env={"COLUMNS": "400"}
        )
        assert shown.returncode == 0, shown.stderr
        [runner_row] = [line for line in shown.stdout.splitlines() if runner_id in line]
        assert "attached to another kernel" in runner_row and "unreachable" not in runner_row
        assert edge_a in shown.stdout and edge_b in shown.stdout
