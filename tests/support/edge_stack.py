"""A real edge over real HTTP on an in-process cluster: what `stack` yields.

The `stack` fixture (tests/edge/conftest.py) builds it: an in-process
ledger and kernel (tests/support/cluster.py), a compaction server, an
EdgeServer on 127.0.0.1:0 and an httpx client carrying ADMIN_KEY, the key of
tenant "default" that `keel up` prints (its admin and an operator).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from compaction.server import CompactionServer
from edge.gateway import Gateway
from edge.server import EdgeServer
from services.ledger import CommittedFact
from services.ledger.client import FactToAppend
from services.runner.config import RunnerConfig
from services.runner.server import RunnerServer
from tests.support.cluster import Cluster

ADMIN_KEY = "edge-test-admin-key-0123456789"


DEADLINE_S = 30.0


@dataclass
class Stack:
    cluster: Cluster
    edge: EdgeServer
    http: httpx.AsyncClient
    compaction: CompactionServer
    runners: list[RunnerServer] = field(default_factory=list)

    @property
    def gateway(self) -> Gateway:
        assert self.edge.gateway is not None
        return self.edge.gateway

    @property
    def url(self) -> str:
        return self.edge.url

    @property
    def grpc_address(self) -> str:
        """host:port of the edge's public gRPC API (keel.sessions.v1)."""
        assert self.edge.grpc_address is not None
        return self.edge.grpc_address

    async def new_session(self, session_id: str | None = None) -> str:
        body = {"id": session_id} if session_id else {}
        response = await self.http.post("/v1/sessions", json=body)
        assert response.status_code == 201, response.text
        sid: str = response.json()["id"]
        return sid

    async def post_input(self, session_id: str, text: str, request_id: str) -> httpx.Response:
        return await self.http.post(
            f"/v1/sessions/{session_id}/inputs", json={"text": text, "requestId": request_id}
        )

    def client(self, key: str) -> httpx.AsyncClient:
        """An HTTP client of this edge sending `key` (the caller closes it)."""
        return httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(DEADLINE_S),
        )

    @staticmethod
    def ledger_id(session_id: str, tenant: str = "default") -> str:
        """The ledger's id of a session the edge calls `session_id`."""
        return f"{tenant}:{session_id}"

    async def facts(self, session_id: str) -> list[CommittedFact]:
        return await self.cluster.facts(self.ledger_id(session_id))

    async def append_inputs(self, session_id: str, count: int, prefix: str = "bulk") -> int:
        """Commits `count` input facts straight to the ledger; returns the head."""
        head = 0
        for start in range(0, count, 250):
            batch = [
                FactToAppend("input", {"text": f"{prefix} {i}", "requestId": f"{prefix}-{i}"})
                for i in range(start, min(start + 250, count))
            ]
            appended = await self.cluster.ledger.append(self.ledger_id(session_id), batch)
            head = appended[-1].seq
        return head

    async def start_runner(self) -> RunnerServer:
        cluster = self.cluster
        runner = await RunnerServer(
            cluster.settings,
            RunnerConfig(cluster.ledger_server.target, cluster.kernel_server.target),
        ).start()
        self.runners.append(runner)
        return runner
