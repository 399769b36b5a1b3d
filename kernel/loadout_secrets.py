"""What a tenant's loadout may point at: the operator's `SecretPolicy`.

The schema (kernel.loadout) says what any loadout may look like; this says
which secrets and which provider origins one tenant's loadout may name. A
loadout names the runner's environment variables that hold secrets
(`model.apiKeyEnv`, an MCP source's `headersEnv` and `env`), and a model's
`baseUrl` says where the runner sends the key. Unchecked, a tenant could name
another tenant's key (or Keel's own `KEEL_*` configuration) and point
`baseUrl` at a host of its own to receive it as a bearer token.

So the kernel applies the operator's policy when a tenant's loadout is
written (PutLoadout, with the tenant's id), and the runner applies the same
rules again when it reads the secret (agent_io.providers), so a grant
the operator withdraws later takes effect without rewriting any loadout.

A tool source picks what a runner executes and where it connects: an MCP
server's stdio `command` must be one the operator allows this tenant
(`KEEL_MCP_COMMANDS`, an exact whole-command match), an MCP `url` and a gRPC
`target` must be allowed by `KEEL_TOOL_TARGETS`; both are closed by default
(services.common.secrets). The runner applies the same checks again when it
builds the source.

A model of kind openai or anthropic without `apiKeyEnv` reads the default
variable (`DEFAULT_KEY_ENV`); without `baseUrl` it calls the official API
(`OFFICIAL_BASE_URL`). With a `baseUrl` and no `apiKeyEnv` it is a server
that may need no key: the default variable is sent only if it is granted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernel.errors import InvalidLoadout
from kernel.loadout_fields import member_path
from services.common.secrets import (
    DEFAULT_KEY_ENV,
    OFFICIAL_BASE_URL,
    SecretPolicy,
    command_refused,
    not_granted,
    origin_refused,
    target_refused,
)


def _refuse(field: str, message: str) -> InvalidLoadout:
    return InvalidLoadout(f"{field}: {message}", field=field)


def _granted(tenant_id: str, name: Any, field: str, policy: SecretPolicy) -> None:
    if isinstance(name, str) and not policy.may_read(tenant_id, name):
        raise _refuse(field, not_granted(tenant_id, name))


def _check_model(model: Mapping[str, Any], tenant_id: str, policy: SecretPolicy) -> None:
    kind = model.get("provider") or "scripted"
    if kind not in DEFAULT_KEY_ENV:
        return  # the scripted model reads no secret and calls nothing
    base_url = model.get("baseUrl")
    key_env = model.get("apiKeyEnv")
    if base_url is None:
        official = OFFICIAL_BASE_URL[kind]
        if not policy.allows_origin(official):
            raise _refuse(
                "model.baseUrl",
                f"is not set, so the official API is called: {origin_refused(official, policy)}",
            )
    elif isinstance(base_url, str) and not policy.allows_origin(base_url):
        raise _refuse("model.baseUrl", origin_refused(base_url, policy))
    if key_env is not None:
        _granted(tenant_id, key_env, "model.apiKeyEnv", policy)
    elif base_url is None:
        # The official API needs a key: the default variable, which must be
        # this tenant's too.
        default = DEFAULT_KEY_ENV[kind]
        if not policy.may_read(tenant_id, default):
            raise _refuse(
                "model.apiKeyEnv",
                f"is not set, so ${default} would be read: {not_granted(tenant_id, default)}",
            )


def _check_tool(tool: Mapping[str, Any], field: str, tenant_id: str, policy: SecretPolicy) -> None:
    source = tool.get("source")
    command, url, target = tool.get("command"), tool.get("url"), tool.get("target")
    if source == "mcp" and isinstance(command, list) and command:
        argv = [str(arg) for arg in command]
        if not policy.allows_command(tenant_id, argv):
            raise _refuse(f"{field}.command", command_refused(tenant_id, argv))
    if source == "mcp" and isinstance(url, str) and not policy.allows_tool_url(tenant_id, url):
        raise _refuse(f"{field}.url", target_refused(tenant_id, url))
    allowed_target = isinstance(target, str) and policy.allows_tool_target(tenant_id, target)
    if source == "grpc" and isinstance(target, str) and not allowed_target:
        raise _refuse(f"{field}.target", target_refused(tenant_id, target))
    for key in ("headersEnv", "env"):
        names = tool.get(key)
        if isinstance(names, Mapping):
            for member, name in names.items():
                _granted(tenant_id, name, member_path(f"{field}.{key}", member), policy)


def check_loadout_secrets(
    document: Mapping[str, Any], tenant_id: str, policy: SecretPolicy
) -> None:
    """Refuses (InvalidLoadout naming the field) a loadout naming a variable
    the operator has not granted to `tenant_id`, a provider origin it does
    not allow, or a tool source's command or target it has not allowed.
    `document` is one the schema accepted."""
    model = document.get("model")
    if isinstance(model, Mapping):
        _check_model(model, tenant_id, policy)
    tools = document.get("tools")
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            if isinstance(tool, Mapping):
                _check_tool(tool, f"tools[{index}]", tenant_id, policy)
