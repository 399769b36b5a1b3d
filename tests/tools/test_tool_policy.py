"""The operator's policy for tool sources, as the runner applies it when it
builds a source: the stdio commands it may start (KEEL_MCP_COMMANDS), the
targets it may call (KEEL_TOOL_TARGETS) and the variables a source may read
(KEEL_SECRET_GRANTS). Closed by default; a refused source has no tools and
each call of it is an error result naming the setting to change. What is
allowed runs for real: the MCP test server over stdio and HTTP, and the
gRPC test ToolService. (The kernel's side, when a loadout is written, is in
tests/kernel/test_secret_rules.py.)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from agent_io.loadout import Loadout
from agent_io.tools import ToolCall, ToolRegistry, idempotency_key
from agent_io.tools.factory import SourceFactory, ToolDefaults
from agent_io.tools.tool_tokens import ToolTokens
from services.common.secrets import SecretPolicy, SecretPolicyError
from tests.support.mcp_server import HttpMcpServer, server_command
from tests.support.tool_service import RunningToolService, launched

pytestmark = pytest.mark.slow

COMMAND = list(server_command())
RUNNER_ENV = {"ACME_FILES_TOKEN": "files-secret", "ACME_SEARCH_TOKEN": "Bearer search-secret"}


def mcp_stdio(**fields: Any) -> dict[str, Any]:
    return {"source": "mcp", "name": "files", "transport": "stdio", "command": COMMAND, **fields}


def grpc(target: str) -> dict[str, Any]:
    return {"source": "grpc", "name": "billing", "target": target}


def mcp_http(url: str, **fields: Any) -> dict[str, Any]:
    return {"source": "mcp", "name": "search", "transport": "http", "url": url, **fields}


def registry(
    policy: SecretPolicy,
    *tools: dict[str, Any],
    tenant: str = "acme",
    env: Mapping[str, str] = RUNNER_ENV,
    token: str = "",
) -> ToolRegistry:
    factory = SourceFactory({}, policy, env, ToolDefaults(grpc_tokens=ToolTokens(token)))
    loadout = Loadout.from_document(1, {"tools": list(tools)})
    return ToolRegistry(factory.slots(tenant, loadout))


async def run(tools: ToolRegistry, name: str, **arguments: Any) -> tuple[bool, str]:
    key = idempotency_key("acme", "s1", "call-1")
    outcome = await tools.run(ToolCall("call-1", name, arguments, key, "s1", "acme"))
    return outcome.is_error, outcome.content


@pytest.fixture
async def closing() -> AsyncIterator[list[ToolRegistry]]:
    """Registries a test opens; their sources are closed at its end."""
    opened: list[ToolRegistry] = []
    yield opened
    for tools in opened:
        for slot in tools.slots:
            await slot.aclose()


# -- the settings --


def test_nothing_is_allowed_unless_the_operator_says_so() -> None:
    for policy in (SecretPolicy(), SecretPolicy.from_env({})):
        assert not policy.allows_command("acme", COMMAND)
        assert not policy.allows_tool_target("acme", "127.0.0.1:7000")
        assert not policy.allows_tool_url("acme", "http://127.0.0.1:7000/mcp")


def test_commands_are_whole_command_lines_per_tenant_or_for_all() -> None:
    policy = SecretPolicy.from_env(
        {"KEEL_MCP_COMMANDS": " npx -y @acme/files ; acme='/opt/acme mcp' --root '/srv/a b' "}
    )
    assert policy.allows_command("acme", ["npx", "-y", "@acme/files"])
    assert policy.allows_command("globex", ["npx", "-y", "@acme/files"])
    assert policy.allows_command("acme", ["/opt/acme mcp", "--root", "/srv/a b"])
    assert not policy.allows_command("globex", ["/opt/acme mcp", "--root", "/srv/a b"])
    for argv in (["npx", "-y"], ["npx", "-y", "@acme/files", "--evil"], ["npx", "@acme/files"]):
        assert not policy.allows_command("acme", argv)


def test_targets_are_grpc_addresses_and_mcp_origins_per_tenant_or_for_all() -> None:
    policy = SecretPolicy.from_env(
        {
            "KEEL_TOOL_TARGETS": "billing.internal:7000, grpcs://ledger:443,"
            "acme=http://127.0.0.1:8000/ ,acme=search.acme:9000"
        }
    )
    assert policy.allows_tool_target("globex", "billing.internal:7000")
    assert policy.allows_tool_target("globex", "grpcs://billing.internal:7000")  # TLS is fine
    assert policy.allows_tool_target("globex", "grpcs://ledger:443")
    assert not policy.allows_tool_target("globex", "ledger:443")  # but not plaintext
    assert policy.allows_tool_target("acme", "search.acme:9000")
    assert not policy.allows_tool_target("globex", "search.acme:9000")
    assert not policy.allows_tool_target("acme", "billing.internal:7001")
    assert policy.allows_tool_url("acme", "http://127.0.0.1:8000/mcp")
    assert not policy.allows_tool_url("acme", "https://127.0.0.1:8000/mcp")
    assert not policy.allows_tool_url("globex", "http://127.0.0.1:8000/mcp")
    # A gRPC entry is not an HTTP origin, nor the reverse.
    assert not policy.allows_tool_url("acme", "http://search.acme:9000/mcp")
    assert not policy.allows_tool_target("acme", "127.0.0.1:8000")


def test_a_wildcard_allows_every_target_for_development() -> None:
    anything = SecretPolicy.from_env({"KEEL_TOOL_TARGETS": "*"})
    assert anything.allows_tool_target("acme", "anywhere:1")
    assert anything.allows_tool_url("acme", "https://anywhere.example/mcp")
    assert not anything.allows_command("acme", COMMAND)  # commands have no wildcard
    one = SecretPolicy.from_env({"KEEL_TOOL_TARGETS": "acme=*"})
    assert one.allows_tool_target("acme", "anywhere:1")
    assert not one.allows_tool_target("globex", "anywhere:1")


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"KEEL_MCP_COMMANDS": "server 'unclosed"}, "KEEL_MCP_COMMANDS"),
        ({"KEEL_MCP_COMMANDS": "acme=  "}, "KEEL_MCP_COMMANDS"),
        ({"KEEL_TOOL_TARGETS": "billing.internal"}, "KEEL_TOOL_TARGETS"),
        ({"KEEL_TOOL_TARGETS": "*.internal:7000"}, "KEEL_TOOL_TARGETS"),
        ({"KEEL_TOOL_TARGETS": "ftp://files:21"}, "KEEL_TOOL_TARGETS"),
    ],
)
def test_a_setting_that_cannot_be_used_is_refused_naming_it(
    env: dict[str, str], variable: str
) -> None:
    with pytest.raises(SecretPolicyError, match=variable):
        SecretPolicy.from_env(env)


def test_a_child_process_gets_the_same_policy() -> None:
    policy = (
        SecretPolicy()
        .with_command(COMMAND, "acme")
        .with_command(["plain", "server"])
        .with_tool_target("billing:7000", "acme")
        .with_tool_target("http://127.0.0.1:8000")
    )
    assert SecretPolicy.from_env(policy.to_env()) == policy


# -- when the runner builds a source --


@pytest.mark.parametrize(
    ("tool", "variable"),
    [
        (mcp_stdio(), "KEEL_MCP_COMMANDS"),
        (mcp_http("http://127.0.0.1:9/mcp"), "KEEL_TOOL_TARGETS"),
        (grpc("127.0.0.1:9"), "KEEL_TOOL_TARGETS"),
    ],
)
async def test_a_refused_source_has_no_tools_and_says_which_setting(
    tool: dict[str, Any], variable: str
) -> None:
    tools = registry(SecretPolicy(), tool)
    await tools.prepare()
    assert tools.specs == ()
    assert not tools.slots[0].opened  # nothing started, nothing dialled
    name = f"{tool['name']}.echo"
    is_error, content = await run(tools, name, text="hi")
    assert is_error and variable in content and "tenant 'acme'" in content
    assert content.startswith(f"tool source {tool['name']!r} is unavailable: ")


async def test_an_allowed_stdio_server_runs_with_its_granted_variables(
    closing: list[ToolRegistry],
) -> None:
    policy = SecretPolicy().with_command(COMMAND, "acme").with_grant("acme", "ACME_FILES_TOKEN")
    tools = registry(policy, mcp_stdio(env={"FILES_TOKEN": "ACME_FILES_TOKEN"}))
    closing.append(tools)
    await tools.prepare()
    assert "files.echo" in [spec.name for spec in tools.specs]
    assert await run(tools, "files.echo", text="hi") == (False, "hi")
    is_error, content = await run(tools, "files.environment")
    assert not is_error and "FILES_TOKEN" in json.loads(content)["names"]


async def test_the_same_loadout_is_refused_for_a_tenant_not_allowed(
    closing: list[ToolRegistry],
) -> None:
    policy = SecretPolicy().with_command(COMMAND, "acme")
    acme, globex = registry(policy, mcp_stdio()), registry(policy, mcp_stdio(), tenant="globex")
    closing += [acme, globex]
    assert await run(acme, "files.echo", text="hi") == (False, "hi")
    is_error, content = await run(globex, "files.echo", text="hi")
    assert is_error and "KEEL_MCP_COMMANDS" in content and "'globex'" in content
    assert not globex.slots[0].opened


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"TOKEN": "GLOBEX_TOKEN"}, "has not granted $GLOBEX_TOKEN to tenant 'acme'"),
        ({"TOKEN": "ACME_UNSET"}, "$ACME_UNSET is granted to tenant 'acme' but not set"),
    ],
)
async def test_a_variable_not_granted_or_not_set_refuses_the_source(
    env: dict[str, str], says: str
) -> None:
    policy = SecretPolicy().with_command(COMMAND).with_grant("acme", "ACME_UNSET")
    tools = registry(policy, mcp_stdio(env=env), env={**RUNNER_ENV, "GLOBEX_TOKEN": "x"})
    is_error, content = await run(tools, "files.echo", text="hi")
    assert is_error and says in content
    assert "KEEL_SECRET_GRANTS" in content or "not set" in content
    assert not tools.slots[0].opened


@pytest.fixture
def http_server() -> Iterator[HttpMcpServer]:
    server = HttpMcpServer(["--require-header", "Authorization:Bearer search-secret"])
    yield server
    server.stop()


async def test_an_allowed_http_server_gets_its_granted_headers(
    http_server: HttpMcpServer, closing: list[ToolRegistry]
) -> None:
    search = mcp_http(http_server.url, headersEnv={"Authorization": "ACME_SEARCH_TOKEN"})
    refused = registry(SecretPolicy().with_grant("acme", "ACME_SEARCH_TOKEN"), search)
    is_error, content = await run(refused, "search.echo", text="hi")
    assert is_error and "KEEL_TOOL_TARGETS" in content
    origin = http_server.url.removesuffix("/mcp")
    policy = SecretPolicy().with_grant("acme", "ACME_SEARCH_TOKEN").with_tool_target(origin, "acme")
    tools = registry(policy, search)
    closing.append(tools)
    assert await run(tools, "search.echo", text="hi") == (False, "hi")


@pytest.fixture
def tool_service(tmp_path: Path) -> Iterator[RunningToolService]:
    with launched(tmp_path / "effects.json", token="tool-token-for-the-policy-tests") as service:
        yield service


async def test_an_allowed_grpc_service_is_called_with_the_runners_tool_token(
    tool_service: RunningToolService, closing: list[ToolRegistry]
) -> None:
    policy = SecretPolicy().with_tool_target(tool_service.address, "acme")
    tools = registry(policy, grpc(tool_service.address), token="tool-token-for-the-policy-tests")
    closing.append(tools)
    assert await run(tools, "billing.echo", text="hi") == (False, "hi")
    other = registry(policy, grpc(tool_service.address), tenant="globex")
    is_error, content = await run(other, "billing.echo", text="hi")
    assert is_error and "KEEL_TOOL_TARGETS" in content
