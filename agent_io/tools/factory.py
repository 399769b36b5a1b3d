"""Building a loadout's tool sources under the operator's policy.

A loadout item becomes a `SourceSlot` whose opener builds the source only
when a session first needs its tools. The opener applies the operator's
policy again (the kernel applied it when the loadout was written, but the
operator may have withdrawn something since): an MCP stdio command must be
allowed by `KEEL_MCP_COMMANDS`, an MCP URL or gRPC target by
`KEEL_TOOL_TARGETS`, and every variable named by `env` / `headersEnv` must
be granted to the tenant by `KEEL_SECRET_GRANTS` (and set). The values are
resolved here, so a source only ever sees what it may send. A refused
source has no tools, and a call of one of them is an error result naming
the setting to change (services.common.secrets).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent_io.loadout import Loadout, ToolSourceItem
from agent_io.tools.base import (
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_TOOL_TIMEOUT_S,
    BlobSink,
    ToolSource,
)
from agent_io.tools.builtin import BuiltinSource, Tool
from agent_io.tools.registry import SourceRefused, SourceSettings, SourceSlot
from agent_io.tools.tool_tokens import ToolTokens
from services.common.secrets import (
    SecretPolicy,
    command_refused,
    not_granted,
    target_refused,
)

__all__ = ["SourceFactory", "ToolDefaults"]


@dataclass(frozen=True)
class ToolDefaults:
    """The runner's side of tool settings."""

    # A call's timeout when its source sets no `timeoutMs`.
    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    # The most a result may hold (UTF-8 bytes of its text): the default, and
    # the ceiling of a source's `maxResultBytes` (a result must fit a fact).
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    # What each gRPC ToolService is sent (KEEL_TOOL_TOKENS, KEEL_TOOL_TOKEN).
    grpc_tokens: ToolTokens = field(default_factory=ToolTokens, repr=False)


def settings_of(item: ToolSourceItem, defaults: ToolDefaults) -> SourceSettings:
    timeout_s = item.timeout_ms / 1000 if item.timeout_ms else defaults.timeout_s
    limit = defaults.max_result_bytes
    if item.max_result_bytes:
        limit = min(item.max_result_bytes, limit)
    return SourceSettings(timeout_s, limit, item.require_approval)


class SourceFactory:
    """Builds the slots of one tenant's loadout; each call builds new ones
    (no source instance is ever shared between tenants or revisions)."""

    def __init__(
        self,
        builtins: Mapping[str, Tool],
        policy: SecretPolicy,
        env: Mapping[str, str],
        defaults: ToolDefaults | None = None,
        blob_sinks: Callable[[str], BlobSink | None] | None = None,
    ) -> None:
        self._builtins = builtins
        self._policy = policy
        self._env = env
        self._defaults = defaults or ToolDefaults()
        self._blob_sinks = blob_sinks

    def slots(self, tenant_id: str, loadout: Loadout) -> list[SourceSlot]:
        slots: list[SourceSlot] = []
        for item in loadout.tool_sources:
            settings = settings_of(item, self._defaults)
            slots.append(
                SourceSlot(
                    item.name,
                    self._opener(tenant_id, item),
                    settings,
                    prefixed=item.prefixed,
                )
            )
        return slots

    def _opener(self, tenant_id: str, item: ToolSourceItem) -> Callable[[], ToolSource]:
        if item.source == "mcp":
            return lambda: self._mcp(tenant_id, item)
        if item.source == "grpc":
            return lambda: self._grpc(tenant_id, item)
        return lambda: BuiltinSource(self._builtins, item.names)

    def _resolve(self, tenant_id: str, names: Mapping[str, str]) -> dict[str, str]:
        """`{key: VARIABLE}` → `{key: value}`, each variable granted and set."""
        values: dict[str, str] = {}
        for key, variable in names.items():
            if not self._policy.may_read(tenant_id, variable):
                raise SourceRefused(not_granted(tenant_id, variable))
            value = self._env.get(variable)
            if value is None:
                raise SourceRefused(
                    f"${variable} is granted to tenant {tenant_id!r} but not set "
                    "in the runner's environment"
                )
            values[key] = value
        return values

    def _mcp(self, tenant_id: str, item: ToolSourceItem) -> ToolSource:
        # Imported on first use: the SDK takes most of a second to import,
        # which every runner (and `keel drain --local`) would pay otherwise.
        from agent_io.tools.mcp import McpServerConfig, McpSource

        sink = self._blob_sinks(tenant_id) if self._blob_sinks is not None else None
        log_name = f"{tenant_id}/{item.name}"
        if item.transport == "stdio":
            if not self._policy.allows_command(tenant_id, item.command):
                raise SourceRefused(command_refused(tenant_id, item.command))
            config = McpServerConfig(
                name=item.name,
                transport="stdio",
                command=item.command,
                env=self._resolve(tenant_id, item.env),
                log_name=log_name,
            )
        elif item.transport == "http":
            if not self._policy.allows_tool_url(tenant_id, item.url):
                raise SourceRefused(target_refused(tenant_id, item.url))
            config = McpServerConfig(
                name=item.name,
                transport="http",
                url=item.url,
                headers=self._resolve(tenant_id, item.headers_env),
                log_name=log_name,
            )
        else:
            raise SourceRefused(f"no MCP transport {item.transport!r} (stdio or http)")
        return McpSource(config, sink)

    def _grpc(self, tenant_id: str, item: ToolSourceItem) -> ToolSource:
        from agent_io.tools.grpc_source import GrpcSourceConfig, GrpcToolSource

        if not self._policy.allows_tool_target(tenant_id, item.target):
            raise SourceRefused(target_refused(tenant_id, item.target))
        config = GrpcSourceConfig(
            name=item.name,
            target=item.target,
            token=self._defaults.grpc_tokens.for_target(tenant_id, item.target),
        )
        return GrpcToolSource(config)
