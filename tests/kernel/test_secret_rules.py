"""The operator's secret rules, where a loadout is written (the kernel) and
where its secret is read (the runner's provider factory); the rules on the
commands and targets of tool sources where a loadout is written (the
runner's side is in tests/tools/test_tool_policy.py); and weak API keys.

The attack these refuse: a tenant names a variable of the runner that is not
its own (another tenant's provider key, KEEL_DEV_KEY, KEEL_INTERNAL_TOKEN) or
points its model at a host of its own, to receive the secret there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from agent_io.providers import ModelConfigError, OpenAICompatible, provider_from_loadout
from kernel import InvalidLoadout, KernelClient, KernelServer
from kernel.errors import WeakApiKey
from kernel.loadout_secrets import check_loadout_secrets
from services.common.config import Settings
from services.common.secrets import SecretPolicy
from tests.support.kernel_stores import FAST

LOCAL = "http://127.0.0.1:9"
POLICY = (
    SecretPolicy()
    .with_grant("acme", "ACME_KEY")
    .with_grant("acme", "ACME_SEARCH_TOKEN")
    .with_grant("globex", "GLOBEX_KEY")
    .with_grant("globex", "OPENAI_API_KEY")
    .with_origin(LOCAL)
    .with_command(["acme-files", "--stdio"], "acme")
    .with_tool_target("billing.internal:7000", "acme")
)
ENV = {
    "ACME_KEY": "acme-secret",
    "GLOBEX_KEY": "globex-secret",
    "OPENAI_API_KEY": "globex-openai-secret",
    "KEEL_DEV_KEY": "keel-dev-secret",
    "KEEL_INTERNAL_TOKEN": "keel-internal-secret",
}


def _openai(**fields: Any) -> dict[str, Any]:
    return {"provider": "openai", "name": "gpt", **fields}


def _refused(document: dict[str, Any], tenant: str = "acme") -> InvalidLoadout:
    with pytest.raises(InvalidLoadout) as caught:
        check_loadout_secrets(document, tenant, POLICY)
    return caught.value


# -- when the loadout is written --


@pytest.mark.parametrize(
    ("model", "field", "named"),
    [
        (_openai(apiKeyEnv="GLOBEX_KEY", baseUrl=LOCAL), "model.apiKeyEnv", "$GLOBEX_KEY"),
        (
            _openai(apiKeyEnv="OPENAI_API_KEY", baseUrl=LOCAL),
            "model.apiKeyEnv",
            "KEEL_SECRET_GRANTS",
        ),
        (_openai(apiKeyEnv="KEEL_DEV_KEY", baseUrl=LOCAL), "model.apiKeyEnv", "$KEEL_DEV_KEY"),
        # No apiKeyEnv and no baseUrl: OPENAI_API_KEY would be read.
        (_openai(), "model.apiKeyEnv", "$OPENAI_API_KEY"),
        (
            _openai(apiKeyEnv="ACME_KEY", baseUrl="https://evil.example"),
            "model.baseUrl",
            "KEEL_PROVIDER_ORIGINS",
        ),
        (
            _openai(apiKeyEnv="ACME_KEY", baseUrl="http://127.0.0.1:10"),
            "model.baseUrl",
            "127.0.0.1:10",
        ),
    ],
)
def test_a_model_naming_what_is_not_granted_is_refused(
    model: dict[str, Any], field: str, named: str
) -> None:
    error = _refused({"model": model})
    assert error.metadata["field"] == field and named in error.message


def test_tool_secrets_must_be_granted_too() -> None:
    headers = {"tools": [{"source": "mcp", "headersEnv": {"Authorization": "GLOBEX_KEY"}}]}
    assert _refused(headers).metadata["field"] == "tools[0].headersEnv.Authorization"
    child = {"tools": ["clock", {"source": "mcp", "env": {"TOKEN": "KEEL_INTERNAL_TOKEN"}}]}
    assert _refused(child).metadata["field"] == "tools[1].env.TOKEN"
    granted = {"tools": [{"source": "mcp", "headersEnv": {"Authorization": "ACME_SEARCH_TOKEN"}}]}
    check_loadout_secrets(granted, "acme", POLICY)


MCP_STDIO = {"source": "mcp", "name": "files", "transport": "stdio", "command": ["acme-files"]}
MCP_HTTP = {"source": "mcp", "name": "search", "transport": "http", "url": "http://127.0.0.1:9/m"}
GRPC = {"source": "grpc", "name": "billing", "target": "billing.internal:7000"}


@pytest.mark.parametrize(
    ("tool", "field", "variable"),
    [
        (
            {**MCP_STDIO, "command": ["acme-files", "--stdio"]},
            "tools[0].command",
            "KEEL_MCP_COMMANDS",
        ),
        (MCP_HTTP, "tools[0].url", "KEEL_TOOL_TARGETS"),
        (GRPC, "tools[0].target", "KEEL_TOOL_TARGETS"),
    ],
)
def test_tool_commands_and_targets_are_closed_by_default(
    tool: dict[str, Any], field: str, variable: str
) -> None:
    with pytest.raises(InvalidLoadout) as caught:
        check_loadout_secrets({"tools": [tool]}, "acme", SecretPolicy())
    assert caught.value.metadata["field"] == field
    assert variable in caught.value.message and "'acme'" in caught.value.message


def test_tool_commands_and_targets_the_operator_allows_are_accepted_for_their_tenant() -> None:
    policy = SecretPolicy.from_env(
        {
            "KEEL_MCP_COMMANDS": "acme=acme-files --stdio;shared-server --stdio",
            "KEEL_TOOL_TARGETS": "acme=billing.internal:7000,http://127.0.0.1:9",
        }
    )
    acme = {
        "tools": [
            {**MCP_STDIO, "command": ["acme-files", "--stdio"]},
            {**MCP_STDIO, "name": "shared", "command": ["shared-server", "--stdio"]},
            MCP_HTTP,
            GRPC,
            {**GRPC, "name": "tls", "target": "grpcs://billing.internal:7000"},
        ]
    }
    check_loadout_secrets(acme, "acme", policy)
    # Another tenant gets what is allowed to all, not what is acme's.
    check_loadout_secrets({"tools": acme["tools"][1:3]}, "globex", policy)
    for index, field in ((0, "command"), (3, "target"), (4, "target")):
        with pytest.raises(InvalidLoadout) as caught:
            check_loadout_secrets({"tools": [acme["tools"][index]]}, "globex", policy)
        assert caught.value.metadata["field"] == f"tools[0].{field}"


@pytest.mark.parametrize(
    "command",
    [
        ["acme-files"],  # fewer arguments
        ["acme-files", "--stdio", "--root=/"],  # more arguments
        ["acme-files", "--stdio "],  # not the same argument
        ["/usr/bin/acme-files", "--stdio"],  # another path to it
    ],
)
def test_a_command_is_allowed_only_as_the_whole_command_line(command: list[str]) -> None:
    with pytest.raises(InvalidLoadout) as caught:
        check_loadout_secrets({"tools": [{**MCP_STDIO, "command": command}]}, "acme", POLICY)
    assert caught.value.metadata["field"] == "tools[0].command"


def test_what_is_granted_is_accepted() -> None:
    for model in (
        _openai(apiKeyEnv="ACME_KEY", baseUrl=LOCAL),
        _openai(apiKeyEnv="ACME_KEY"),  # the official API, allowed by default
        _openai(baseUrl=f"{LOCAL}/v1"),  # a server that may need no key
        {"provider": "scripted"},
    ):
        check_loadout_secrets({"model": model}, "acme", POLICY)
    # The default variable, granted to this tenant.
    check_loadout_secrets({"model": _openai()}, "globex", POLICY)


def test_the_official_api_is_refused_when_the_operator_allows_only_others() -> None:
    local_only = SecretPolicy(POLICY.grants, (LOCAL,))
    with pytest.raises(InvalidLoadout) as caught:
        check_loadout_secrets({"model": _openai(apiKeyEnv="ACME_KEY")}, "acme", local_only)
    assert caught.value.metadata["field"] == "model.baseUrl"
    assert "official API" in caught.value.message


# -- when the runner reads the secret --


def _build(model: dict[str, Any], tenant: str = "acme", policy: SecretPolicy = POLICY) -> Any:
    return provider_from_loadout(model, tenant_id=tenant, secrets=policy, env=ENV)


def _sent_key(provider: Any) -> str:
    assert isinstance(provider, OpenAICompatible)
    key: str = provider._client.api_key
    return key


def test_the_runner_reads_only_the_tenants_granted_variable() -> None:
    assert _sent_key(_build(_openai(apiKeyEnv="ACME_KEY", baseUrl=LOCAL))) == "acme-secret"
    for variable in ("GLOBEX_KEY", "OPENAI_API_KEY", "KEEL_DEV_KEY", "KEEL_INTERNAL_TOKEN"):
        with pytest.raises(ModelConfigError, match=rf"not granted \${variable}"):
            _build(_openai(apiKeyEnv=variable, baseUrl=LOCAL))


def test_keels_own_variables_are_never_readable_even_if_listed() -> None:
    # parse_grants refuses KEEL_* names; a policy built around it still does.
    forced = SecretPolicy({"acme": frozenset({"KEEL_DEV_KEY"})}, (LOCAL,))
    with pytest.raises(ModelConfigError, match="not granted"):
        _build(_openai(apiKeyEnv="KEEL_DEV_KEY", baseUrl=LOCAL), policy=forced)


def test_a_withdrawn_grant_is_refused_at_call_time() -> None:
    withdrawn = SecretPolicy({}, POLICY.provider_origins)
    with pytest.raises(ModelConfigError, match=r"not granted \$ACME_KEY"):
        _build(_openai(apiKeyEnv="ACME_KEY", baseUrl=LOCAL), policy=withdrawn)


def test_a_base_url_without_a_key_never_gets_the_default_variable() -> None:
    # OPENAI_API_KEY is globex's: acme's keyless server must not receive it.
    assert _sent_key(_build(_openai(baseUrl=LOCAL))) == "unused"
    assert _sent_key(_build(_openai(baseUrl=LOCAL), tenant="globex")) == "globex-openai-secret"


def test_an_origin_not_allowed_is_refused_at_call_time() -> None:
    with pytest.raises(ModelConfigError, match="not an allowed provider origin"):
        _build(_openai(apiKeyEnv="ACME_KEY", baseUrl="https://evil.example/v1"))
    with pytest.raises(ModelConfigError, match="not an allowed provider origin"):
        _build(_openai(apiKeyEnv="ACME_KEY"), policy=SecretPolicy(POLICY.grants, (LOCAL,)))


# -- through the kernel's API --


@pytest.fixture
async def kernel_client(pg_settings: Settings) -> AsyncIterator[KernelClient]:
    server = await KernelServer(pg_settings.with_overrides(secrets=POLICY), config=FAST).start()
    try:
        async with KernelClient(server.target, server.settings) as client:
            await client.create_tenant("acme")
            yield client
    finally:
        await server.stop()


async def test_the_kernel_applies_the_policy_of_the_tenant_written_to(
    kernel_client: KernelClient,
) -> None:
    granted = {"model": _openai(apiKeyEnv="ACME_KEY", baseUrl=LOCAL)}
    assert await kernel_client.put_loadout("acme", granted) == 1
    tools = {"tools": [{**MCP_STDIO, "command": ["acme-files", "--stdio"]}, GRPC]}
    assert await kernel_client.put_loadout("acme", tools) == 2
    for document, field in (
        ({"model": _openai(apiKeyEnv="GLOBEX_KEY", baseUrl=LOCAL)}, "model.apiKeyEnv"),
        ({"model": _openai(apiKeyEnv="ACME_KEY", baseUrl="http://10.0.0.1")}, "model.baseUrl"),
        ({"tools": [{**MCP_STDIO, "command": ["sh", "-c", "id"]}]}, "tools[0].command"),
        ({"tools": [{**GRPC, "target": "evil.example:7000"}]}, "tools[0].target"),
    ):
        with pytest.raises(InvalidLoadout) as caught:
            await kernel_client.put_loadout("acme", document)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.metadata["field"] == field
    assert (await kernel_client.get_loadout("acme")).revision == 2


@pytest.mark.parametrize(
    "key", ["dev", "dev-key-1", "a" * 40, "abcabcabcabcabcabcabcabc", "x y" * 10]
)
async def test_a_weak_chosen_key_is_refused_with_a_reason(
    kernel_client: KernelClient, key: str
) -> None:
    with pytest.raises(WeakApiKey) as caught:
        await kernel_client.create_api_key("acme", key, admin=True)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason == "WEAK_API_KEY" and caught.value.metadata["field"] == "key"
    assert [k for k in await kernel_client.list_api_keys("acme")] == []
    strong, _ = await kernel_client.create_api_key("acme", "acme-strong-key-0123456789abc")
    assert strong == "acme-strong-key-0123456789abc"
