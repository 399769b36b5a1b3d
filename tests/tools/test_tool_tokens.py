"""Each gRPC ToolService is sent its own token, and a ToolService built with
keel_tools is not open to the network without one.

A real runner process calls two real ToolServices (tests/support/tool_service.py,
separate processes), each refusing any token but its own: a tenant's own
service and one the operator runs for everyone. `KEEL_TOOL_TOKENS` gives the
shared service its token and the tenant's targets theirs; another tenant's
session reaches the tenant's service with the fallback `KEEL_TOOL_TOKEN`
only, and is refused.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from keel_tools import ToolServer
from keel_tools.server import UnsafeToolServer
from services.common.config import Settings
from services.common.secrets import SecretPolicy
from services.ledger import CommittedFact
from tests.support.cluster import Cluster, running_cluster
from tests.support.internal_auth import TEST_TOKEN
from tests.support.keel_up import run_keel
from tests.support.ports import free_port
from tests.support.processes import ChildProcess
from tests.support.tool_service import RunningToolService, launched

pytestmark = pytest.mark.slow

ACME_TOKEN = "tool-token-of-acme-own-service-0123"
BILLING_TOKEN = "tool-token-of-the-billing-service-4567"
FALLBACK_TOKEN = "tool-token-sent-to-every-other-service-89"


@pytest.fixture
def acme_service(tmp_path: Path) -> Iterator[RunningToolService]:
    with launched(tmp_path / "acme-effects.json", token=ACME_TOKEN) as service:
        yield service


@pytest.fixture
def billing_service(tmp_path: Path) -> Iterator[RunningToolService]:
    with launched(tmp_path / "billing-effects.json", token=BILLING_TOKEN) as service:
        yield service


@pytest.fixture
def policy(acme_service: RunningToolService, billing_service: RunningToolService) -> SecretPolicy:
    """Both services for both tenants: the operator allows the targets, the
    tokens say who may call what."""
    policy = SecretPolicy()
    for tenant in ("acme", "globex"):
        policy = policy.with_tool_target(acme_service.address, tenant)
        policy = policy.with_tool_target(billing_service.address, tenant)
    return policy


@pytest.fixture
async def cluster(sqlite_settings: Settings, policy: SecretPolicy) -> AsyncIterator[Cluster]:
    async with running_cluster(sqlite_settings.with_overrides(secrets=policy)) as running:
        for tenant in ("acme", "globex"):
            await running.kernel.create_tenant(tenant)
        yield running


async def ask(cluster: Cluster, tenant: str, session_id: str, text: str) -> Mapping[str, Any]:
    """One input in a new session of `tenant`, answered; its one tool result."""
    await cluster.new_session(session_id, tenant)
    appended = await cluster.ledger.append_one(
        session_id, "input", {"text": text, "requestId": "r1"}
    )
    await cluster.kernel.enqueue(session_id, tenant, input_seq=appended.seq)
    await cluster.settled(session_id)
    facts: list[CommittedFact] = await cluster.facts(session_id)
    (result,) = [fact.data for fact in facts if fact.kind == "tool_result"]
    return result


async def test_each_tool_service_receives_only_its_own_token(
    cluster: Cluster,
    policy: SecretPolicy,
    acme_service: RunningToolService,
    billing_service: RunningToolService,
) -> None:
    tools = [
        {"source": "grpc", "name": "own", "target": acme_service.address},
        {"source": "grpc", "name": "billing", "target": billing_service.address},
    ]
    for tenant in ("acme", "globex"):
        await cluster.kernel.put_loadout(tenant, {"tools": tools})
    runner = cluster.start_runner(
        **policy.to_env(),
        KEEL_TOOL_TOKEN=FALLBACK_TOKEN,
        # The shared service's token for everyone; acme's token for acme's
        # other targets (the more specific target entry wins for billing).
        KEEL_TOOL_TOKENS=(
            f"{billing_service.address}=KEEL_TOOL_TOKEN_BILLING;acme=*=KEEL_TOOL_TOKEN_ACME"
        ),
        KEEL_TOOL_TOKEN_BILLING=BILLING_TOKEN,
        KEEL_TOOL_TOKEN_ACME=ACME_TOKEN,
    )
    await cluster.runner_ready(runner)

    own = await ask(cluster, "acme", "acme-own", '/tool own.echo {"text": "mine"}')
    assert (own["content"], own["isError"]) == ("mine", False)
    shared = await ask(cluster, "acme", "acme-billing", '/tool billing.echo {"text": "bill"}')
    assert (shared["content"], shared["isError"]) == ("bill", False)
    shared = await ask(cluster, "globex", "globex-billing", '/tool billing.echo {"text": "b"}')
    assert (shared["content"], shared["isError"]) == ("b", False)
    # globex's sessions carry the fallback token: acme's service refuses it.
    refused = await ask(cluster, "globex", "globex-own", '/tool own.echo {"text": "x"}')
    assert refused["isError"] and "authentication refused" in refused["content"]


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"KEEL_TOOL_TOKEN": "tool-token"}, "KEEL_TOOL_TOKEN is too weak"),
        (
            {"KEEL_TOOL_TOKENS": "acme=*=KEEL_TOOL_TOKEN_ACME", "KEEL_TOOL_TOKEN_ACME": "a" * 40},
            "KEEL_TOOL_TOKEN_ACME is too weak",
        ),
        ({"KEEL_TOOL_TOKENS": "acme=*=KEEL_TOOL_TOKEN_ACME"}, "$KEEL_TOOL_TOKEN_ACME is not set"),
        ({"KEEL_TOOL_TOKENS": "acme=*=OPENAI_API_KEY"}, "must be named KEEL_TOOL_TOKEN_<NAME>"),
        ({"KEEL_TOOL_TOKENS": "acme=http://x=KEEL_TOOL_TOKEN_X"}, "is neither host:port"),
    ],
    ids=["weak-fallback", "weak-specific", "unset", "not-keels-own", "bad-target"],
)
def test_a_runner_refuses_unusable_tool_tokens_in_one_line(
    env: dict[str, str], problem: str, tmp_path: Path
) -> None:
    result = run_keel(
        "runner", env={"KEEL_DATA_DIR": str(tmp_path), "KEEL_INTERNAL_TOKEN": TEST_TOKEN, **env}
    )
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("keel runner: ") and problem in line, line


def test_keel_up_refuses_an_unusable_tool_token_before_starting(tmp_path: Path) -> None:
    result = run_keel("up", "--data-dir", str(tmp_path), env={"KEEL_TOOL_TOKEN": "tool-token"})
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("keel up: KEEL_TOOL_TOKEN is too weak"), line


SERVE = """
import sys
from keel_tools import serve_tools

def add(a: int, b: int = 1) -> int:
    \"\"\"Adds two numbers.\"\"\"
    return a + b

host = sys.argv[2] if len(sys.argv) > 2 else None
serve_tools([add], port=int(sys.argv[1]), **({{"host": host}} if host else {{}}))
"""


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port` (/proc/net)."""
    found: set[str] = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port and len(address) == width:
                found.add(_address(address))
    return found


def _address(hexed: str) -> str:
    # /proc/net lists each 32-bit word in host (little-endian) order.
    words = [bytes.fromhex(hexed[i : i + 8])[::-1] for i in range(0, len(hexed), 8)]
    raw = b"".join(words)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw)
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in raw[12:])  # v4-mapped
    return ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2))


def test_serve_tools_listens_on_loopback_by_default(tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "serve.py"
    script.write_text(SERVE.format())
    child = ChildProcess([sys.executable, str(script), str(port)], env={"PYTHONPATH": "."})
    try:
        child.wait_for_line(lambda line: "without a token" in line, 60)
        assert _listening_addresses(port) == {"127.0.0.1"}
    finally:
        child.kill()


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]"])
def test_serve_tools_refuses_a_wildcard_address_without_a_token(host: str, tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "serve.py"
    script.write_text(SERVE.format())
    child = ChildProcess([sys.executable, str(script), str(port), host], env={"PYTHONPATH": "."})
    try:
        code = child.proc.wait(timeout=60)
    finally:
        child.kill()
    assert code != 0
    assert f"UnsafeToolServer: refusing to serve tools on {host} without a token" in child.output()
    assert "KEEL_TOOL_TOKEN" in child.output()
    assert _listening_addresses(port) == set()


async def test_a_tool_server_needs_a_strong_token_and_a_token_beyond_loopback() -> None:
    with pytest.raises(UnsafeToolServer, match="too weak"):
        ToolServer([], token="short-token")
    with pytest.raises(UnsafeToolServer, match="too weak"):
        ToolServer([], token="x" * 64)
    with pytest.raises(UnsafeToolServer, match="without a token"):
        await ToolServer([], token="").start("0.0.0.0", 0)
    # With a strong token any address will do.
    server = ToolServer([], token=secrets.token_urlsafe(32))
    try:
        assert await server.start("0.0.0.0", 0) > 0
    finally:
        await server.stop(None)
