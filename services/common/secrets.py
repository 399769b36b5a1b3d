"""Which secrets a tenant may name, and where a provider call may go.

A loadout never holds a secret: it names the runner's environment variable
that does (`apiKeyEnv`, `headersEnv`). Left unchecked, that name is a way to
read the runner's whole environment: a tenant names `KEEL_DEV_KEY` (or
`KEEL_INTERNAL_TOKEN`) and points `baseUrl` at a host of its own. So the
operator grants each tenant the variables it may name
(`KEEL_SECRET_GRANTS="default=OPENAI_API_KEY;acme=ACME_OPENAI_KEY,ACME_SEARCH"`),
Keel's own `KEEL_*` variables can never be granted, and a model may only be
called at an origin the operator allows (`KEEL_PROVIDER_ORIGINS`, the
official APIs by default). The kernel applies both rules when a loadout is
written, the runner again when it reads a secret, so a grant withdrawn later
takes effect without rewriting loadouts.

A loadout's tool sources pick a command a runner executes (an MCP server
over stdio) and network targets it calls (an MCP server over HTTP, a gRPC
ToolService), so both are closed by default and opened by the operator:

- `KEEL_MCP_COMMANDS`: the stdio commands runners may start, `;`-separated,
  each a whole command line split as a shell would (`shlex`), optionally
  prefixed with `tenant=` to allow it for that tenant only:
  `KEEL_MCP_COMMANDS="python -m files_server;acme=/opt/acme/mcp --stdio"`.
  A loadout's `command` must equal an allowed argv exactly (every argument,
  in order; no prefix matching, no wildcards), so a tenant cannot append
  arguments of its own choosing. An entry cannot contain `;`.
- `KEEL_TOOL_TARGETS`: comma-separated gRPC ToolService targets (`host:port`,
  which allows plaintext and TLS, or `grpcs://host:port`, TLS only) and MCP
  HTTP origins (`http(s)://host[:port]`, the port defaulting to the
  scheme's), each optionally prefixed with `tenant=`; `*` alone allows any
  target (for development only). Unset or empty: none.
- The variables an MCP source names (`env`, `headersEnv`) follow
  `KEEL_SECRET_GRANTS` like a model's key.

The kernel refuses a loadout that breaks these rules when it is written
(kernel.loadout_secrets), and the runner checks them again when it builds a
source, where a refused source has no tools and each call of it is an error
result naming the setting to change.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from services.common import settings_registry as registry
from services.common.setting import read_raw, read_text

ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
RESERVED_PREFIX = "KEEL_"
DEFAULT_PROVIDER_ORIGINS = ("https://api.openai.com", "https://api.anthropic.com")
_DEFAULT_PORTS = {"http": 80, "https": 443}
# A tenant id as the kernel accepts it (kernel.domain.check_id).
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})")
ANY_TARGET = "*"
GRANTS_VARIABLE = registry.KEEL_SECRET_GRANTS.name
ORIGINS_VARIABLE = registry.KEEL_PROVIDER_ORIGINS.name
COMMANDS_VARIABLE = registry.KEEL_MCP_COMMANDS.name
TARGETS_VARIABLE = registry.KEEL_TOOL_TARGETS.name


class SecretPolicyError(ValueError):
    """A grant list or origin list an operator wrote cannot be used."""


class SecretNotGranted(PermissionError):
    """A loadout names a variable its tenant was not granted."""


def _origin(url: str) -> tuple[str, str, int] | None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[scheme]


def parse_grants(raw: str) -> dict[str, frozenset[str]]:
    """`tenant=VAR,VAR;tenant2=VAR` → {tenant: {VAR, …}}."""
    grants: dict[str, set[str]] = {}
    for entry in filter(None, (part.strip() for part in raw.split(";"))):
        tenant, equals, names = entry.partition("=")
        tenant = tenant.strip()
        if not equals or not tenant:
            raise SecretPolicyError(
                f"KEEL_SECRET_GRANTS: {entry!r} is not tenant=VARIABLE[,VARIABLE…]"
            )
        for name in filter(None, (n.strip() for n in names.split(","))):
            if not ENV_NAME.fullmatch(name):
                raise SecretPolicyError(f"KEEL_SECRET_GRANTS: {name!r} is not a variable name")
            if name.startswith(RESERVED_PREFIX):
                raise SecretPolicyError(
                    f"KEEL_SECRET_GRANTS: {name} is Keel's own configuration and cannot be granted"
                )
            grants.setdefault(tenant, set()).add(name)
    return {tenant: frozenset(names) for tenant, names in grants.items()}


def parse_origins(raw: str | None) -> tuple[str, ...]:
    """`KEEL_PROVIDER_ORIGINS` (comma-separated `scheme://host[:port]`);
    unset: the official provider APIs."""
    if raw is None:
        return DEFAULT_PROVIDER_ORIGINS
    origins = tuple(filter(None, (part.strip().rstrip("/") for part in raw.split(","))))
    for origin in origins:
        if _origin(origin) is None:
            raise SecretPolicyError(
                f"KEEL_PROVIDER_ORIGINS: {origin!r} is not an http(s)://host[:port] origin"
            )
    return origins


def _tenant_prefix(entry: str) -> tuple[str | None, str]:
    """`tenant=rest` → (tenant, rest); an entry without one → (None, entry)."""
    head, equals, rest = entry.partition("=")
    if equals and _TENANT.fullmatch(head.strip()):
        return head.strip(), rest.strip()
    return None, entry.strip()


@dataclass(frozen=True)
class Allowed:
    """One entry of an allow-list: a value, for one tenant or (None) all."""

    value: str
    tenant: str | None = None

    def covers(self, tenant_id: str) -> bool:
        return self.tenant is None or self.tenant == tenant_id

    def to_entry(self) -> str:
        return self.value if self.tenant is None else f"{self.tenant}={self.value}"


def parse_commands(raw: str) -> tuple[Allowed, ...]:
    """`KEEL_MCP_COMMANDS`: `[tenant=]command line;…`, each command line kept
    in its canonical form (`shlex.join` of its argv)."""
    commands: list[Allowed] = []
    for entry in filter(None, (part.strip() for part in raw.split(";"))):
        tenant, line = _tenant_prefix(entry)
        try:
            argv = shlex.split(line)
        except ValueError as error:
            raise SecretPolicyError(
                f"KEEL_MCP_COMMANDS: {entry!r} does not parse: {error}"
            ) from None
        if not argv:
            raise SecretPolicyError(f"KEEL_MCP_COMMANDS: {entry!r} names no command")
        commands.append(Allowed(shlex.join(argv), tenant))
    return tuple(commands)


def grpc_target(target: str) -> tuple[bool, str, int] | None:
    """A gRPC target as (tls, host, port): `host:port`, `[v6]:port`,
    `grpc://host:port`, `dns:///host:port` or `grpcs://host:port` (TLS); None
    for other forms."""
    tls = False
    rest = target.strip()
    if rest.lower().startswith("grpcs://"):
        tls, rest = True, rest[len("grpcs://") :]
    else:
        for plain in ("grpc://", "dns:///"):
            if rest.lower().startswith(plain):
                rest = rest[len(plain) :]
    match = _HOST_PORT.fullmatch(rest)
    if match is None or not 0 < int(match.group(2)) < 65536:
        return None
    return tls, match.group(1).lower().strip("[]"), int(match.group(2))


def parse_tool_targets(raw: str) -> tuple[Allowed, ...]:
    """`KEEL_TOOL_TARGETS`: `[tenant=]target,…` where a target is a gRPC
    `host:port` / `grpcs://host:port`, an MCP `http(s)://host[:port]`
    origin, or `*` (any)."""
    targets: list[Allowed] = []
    for entry in filter(None, (part.strip() for part in raw.split(","))):
        tenant, value = _tenant_prefix(entry)
        value = value.rstrip("/")
        if value != ANY_TARGET and _origin(value) is None and grpc_target(value) is None:
            raise SecretPolicyError(
                f"KEEL_TOOL_TARGETS: {entry!r} is neither host:port, grpcs://host:port, "
                "an http(s)://host[:port] origin nor *"
            )
        targets.append(Allowed(value, tenant))
    return tuple(targets)


@dataclass(frozen=True)
class SecretPolicy:
    """The operator's rules for tenants' secrets, provider origins, and the
    commands and targets of tool sources."""

    grants: Mapping[str, frozenset[str]] = field(default_factory=dict)
    provider_origins: tuple[str, ...] = DEFAULT_PROVIDER_ORIGINS
    # KEEL_MCP_COMMANDS: canonical command lines (shlex.join of the argv).
    mcp_commands: tuple[Allowed, ...] = ()
    # KEEL_TOOL_TARGETS: gRPC targets and MCP HTTP origins.
    tool_targets: tuple[Allowed, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SecretPolicy:
        return cls(
            parse_grants(read_text(env, registry.KEEL_SECRET_GRANTS)),
            # Unset: the official APIs; set empty: none at all.
            parse_origins(read_raw(env, registry.KEEL_PROVIDER_ORIGINS)),
            parse_commands(read_text(env, registry.KEEL_MCP_COMMANDS)),
            parse_tool_targets(read_text(env, registry.KEEL_TOOL_TARGETS)),
        )

    def may_read(self, tenant_id: str, name: str) -> bool:
        """Whether `tenant_id`'s loadout may name the variable `name`."""
        if not ENV_NAME.fullmatch(name) or name.startswith(RESERVED_PREFIX):
            return False
        return name in self.grants.get(tenant_id, frozenset())

    def read(self, tenant_id: str, name: str, env: Mapping[str, str]) -> str | None:
        """The value of a granted variable (None when unset); raises
        SecretNotGranted for any other name."""
        if not self.may_read(tenant_id, name):
            raise SecretNotGranted(
                f"the operator has not granted ${name} to tenant {tenant_id!r} (KEEL_SECRET_GRANTS)"
            )
        return env.get(name)

    def allows_origin(self, url: str) -> bool:
        """Whether a provider call to `url` stays inside the allowed origins."""
        wanted = _origin(url)
        return wanted is not None and any(_origin(o) == wanted for o in self.provider_origins)

    def allows_command(self, tenant_id: str, argv: Sequence[str]) -> bool:
        """Whether `tenant_id`'s loadout may have runners start `argv`
        (an exact match of a whole allowed command line)."""
        line = shlex.join(argv)
        return any(c.value == line and c.covers(tenant_id) for c in self.mcp_commands)

    def allows_tool_target(self, tenant_id: str, target: str) -> bool:
        """Whether runners may call a gRPC ToolService at `target` for
        `tenant_id`. An allowed `host:port` also allows TLS to it."""
        wanted = grpc_target(target)
        if wanted is None:
            return self._any_target(tenant_id)
        for entry in self.tool_targets:
            if not entry.covers(tenant_id):
                continue
            if entry.value == ANY_TARGET:
                return True
            allowed = grpc_target(entry.value)
            if allowed is not None and allowed[1:] == wanted[1:] and (wanted[0] or not allowed[0]):
                return True
        return False

    def allows_tool_url(self, tenant_id: str, url: str) -> bool:
        """Whether runners may call an MCP server at `url` for `tenant_id`."""
        wanted = _origin(url)
        if wanted is None:
            return False
        return any(
            entry.covers(tenant_id)
            and (entry.value == ANY_TARGET or _origin(entry.value) == wanted)
            for entry in self.tool_targets
        )

    def _any_target(self, tenant_id: str) -> bool:
        return any(e.value == ANY_TARGET and e.covers(tenant_id) for e in self.tool_targets)

    def with_grant(self, tenant_id: str, name: str) -> SecretPolicy:
        grants = dict(self.grants)
        grants[tenant_id] = grants.get(tenant_id, frozenset()) | {name}
        return replace(self, grants=grants)

    def with_origin(self, url: str) -> SecretPolicy:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        if origin in self.provider_origins:
            return self
        return replace(self, provider_origins=(*self.provider_origins, origin))

    def with_command(self, argv: Sequence[str], tenant_id: str | None = None) -> SecretPolicy:
        """This policy, also allowing runners to start `argv` (for `tenant_id` only, if given)."""
        allowed = Allowed(shlex.join(argv), tenant_id)
        return replace(self, mcp_commands=(*self.mcp_commands, allowed))

    def with_tool_target(self, target: str, tenant_id: str | None = None) -> SecretPolicy:
        """This policy, also allowing a gRPC target or MCP HTTP origin (an
        entry as KEEL_TOOL_TARGETS has it, or one for `tenant_id`)."""
        parsed = parse_tool_targets(target if tenant_id is None else f"{tenant_id}={target}")
        if len(parsed) != 1:
            raise SecretPolicyError(f"KEEL_TOOL_TARGETS: {target!r} is not one target")
        return replace(self, tool_targets=(*self.tool_targets, *parsed))

    def to_env(self) -> dict[str, str]:
        """The variables that give a child process this same policy."""
        grants = ";".join(f"{t}={','.join(sorted(n))}" for t, n in sorted(self.grants.items()))
        return {
            "KEEL_SECRET_GRANTS": grants,
            "KEEL_PROVIDER_ORIGINS": ",".join(self.provider_origins),
            COMMANDS_VARIABLE: ";".join(c.to_entry() for c in self.mcp_commands),
            TARGETS_VARIABLE: ",".join(t.to_entry() for t in self.tool_targets),
        }


# The variable a model reads when its loadout names none.
DEFAULT_KEY_ENV: Mapping[str, str] = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
# Where a model without `baseUrl` is called (the SDKs' own defaults).
OFFICIAL_BASE_URL: Mapping[str, str] = {
    "openai": "https://api.openai.com/v1",
    "anthropic": "https://api.anthropic.com",
}


def not_granted(tenant_id: str, name: str) -> str:
    """Why a tenant may not name the variable `name` (the message of both
    the kernel's refusal and the runner's)."""
    return (
        f"the operator has not granted ${name} to tenant {tenant_id!r} "
        f"(operators grant variables with {GRANTS_VARIABLE}, e.g. {tenant_id}={name})"
    )


def origin_refused(url: str, policy: SecretPolicy) -> str:
    allowed = ", ".join(policy.provider_origins) or "none"
    return (
        f"{url} is not an allowed provider origin (operators allow origins with "
        f"{ORIGINS_VARIABLE}; allowed now: {allowed})"
    )


def command_refused(tenant_id: str, argv: Sequence[str]) -> str:
    """Why runners may not start `argv` for a tenant (the kernel's refusal
    and the runner's)."""
    line = shlex.join(argv)
    return (
        f"the operator has not allowed runners to start {line!r} for tenant {tenant_id!r} "
        f"(operators allow MCP server commands with {COMMANDS_VARIABLE}, "
        f"the whole command line exactly, e.g. {tenant_id}={line})"
    )


def target_refused(tenant_id: str, target: str) -> str:
    """Why runners may not call a tool target (a gRPC target or an MCP URL)."""
    origin = _origin(target)
    shown = f"{origin[0]}://{origin[1]}:{origin[2]}" if origin is not None else target
    return (
        f"the operator has not allowed tool calls to {shown} for tenant {tenant_id!r} "
        f"(operators allow gRPC targets and MCP origins with {TARGETS_VARIABLE}, "
        f"e.g. {tenant_id}={shown})"
    )
