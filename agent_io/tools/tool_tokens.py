"""Which token a runner sends to each gRPC ToolService (`x-keel-tool-token`).

`KEEL_TOOL_TOKEN` alone would be sent to every ToolService, a tenant's own
among them, so whoever runs one service could call every other.
`KEEL_TOOL_TOKENS` gives a target, or a tenant's targets, a token of its own:

    KEEL_TOOL_TOKENS="billing.internal:7000=KEEL_TOOL_TOKEN_BILLING;acme=*=KEEL_TOOL_TOKEN_ACME"

Entries are `;`-separated `[tenant=]target=VARIABLE`: the target written as
`KEEL_TOOL_TARGETS` writes a gRPC one (`host:port`, `grpcs://host:port`; TLS
or not, the same service) or `*` (every target), optionally for one tenant
only; VARIABLE names the runner's variable holding the token, or nothing
(`acme=*=`) to send none. Each variable is named `KEEL_TOOL_TOKEN_…`, so it
is Keel's own configuration, which no `KEEL_SECRET_GRANTS` can hand to a
loadout (services.common.secrets). The most specific entry wins: the
tenant's entry for the target, the target's for every tenant, the tenant's
`*`, a `*` for all; else `KEEL_TOOL_TOKEN`. Every token must be set and as
strong as the internal token (services.common.internal_auth.secret_weakness);
a runner will not start otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common import settings_registry as registry
from services.common.internal_auth import secret_weakness
from services.common.secrets import ANY_TARGET, grpc_target
from services.common.setting import read_text

__all__ = ["FALLBACK_VARIABLE", "TOKENS_VARIABLE", "ToolTokenError", "ToolTokens"]

FALLBACK_VARIABLE = registry.KEEL_TOOL_TOKEN.name
TOKENS_VARIABLE = registry.KEEL_TOOL_TOKENS.name
TOKEN_VARIABLE_PREFIX = registry.KEEL_TOOL_TOKEN_.name
_TOKEN_VARIABLE = re.compile(r"KEEL_TOOL_TOKEN_[A-Z0-9_]{1,100}")
# A tenant id as the kernel accepts it (kernel.domain.check_id).
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}")

# (tenant or None for every tenant, (host, port) or None for every target)
_Key = tuple[str | None, tuple[str, int] | None]


class ToolTokenError(ValueError):
    """KEEL_TOOL_TOKEN or KEEL_TOOL_TOKENS cannot be used (one line, why)."""


def _target_key(target: str, entry: str) -> tuple[str, int] | None:
    if target == ANY_TARGET:
        return None
    parsed = grpc_target(target)
    if parsed is None:
        raise ToolTokenError(
            f"{TOKENS_VARIABLE}: {entry!r}: {target!r} is neither host:port, "
            "grpcs://host:port nor *"
        )
    return parsed[1], parsed[2]


def _token_of(variable: str, env: Mapping[str, str], entry: str) -> str:
    """The token `variable` holds ("" for no variable: send none)."""
    if not variable:
        return ""
    if not _TOKEN_VARIABLE.fullmatch(variable):
        raise ToolTokenError(
            f"{TOKENS_VARIABLE}: {entry!r}: the token's variable must be named "
            f"{TOKEN_VARIABLE_PREFIX}<NAME> (Keel's own, never grantable to a loadout), "
            f"not {variable!r}"
        )
    value = env.get(variable, "")
    if not value:
        raise ToolTokenError(f"{TOKENS_VARIABLE}: {entry!r}: ${variable} is not set")
    weakness = secret_weakness(variable, value)
    if weakness is not None:
        raise ToolTokenError(weakness)
    return value


def parse_tool_tokens(raw: str, env: Mapping[str, str]) -> dict[_Key, str]:
    """`KEEL_TOOL_TOKENS` with each variable read from `env`."""
    tokens: dict[_Key, str] = {}
    for entry in filter(None, (part.strip() for part in raw.split(";"))):
        parts = [part.strip() for part in entry.split("=")]
        if len(parts) == 2:
            tenant, target, variable = None, parts[0], parts[1]
        elif len(parts) == 3 and _TENANT.fullmatch(parts[0]):
            tenant, target, variable = parts
        else:
            raise ToolTokenError(
                f"{TOKENS_VARIABLE}: {entry!r} is not [tenant=]target=VARIABLE "
                f"(e.g. acme=*={TOKEN_VARIABLE_PREFIX}ACME)"
            )
        key = (tenant, _target_key(target, entry))
        if key in tokens:
            raise ToolTokenError(f"{TOKENS_VARIABLE}: {entry!r} repeats an earlier entry")
        tokens[key] = _token_of(variable, env, entry)
    return tokens


@dataclass(frozen=True)
class ToolTokens:
    """The tokens of gRPC ToolServices: per tenant and target, else the fallback."""

    # KEEL_TOOL_TOKEN ("" sends none).
    fallback: str = field(default="", repr=False)
    # From KEEL_TOOL_TOKENS: (tenant | None, (host, port) | None) -> token.
    specific: Mapping[_Key, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ToolTokens:
        """Raises ToolTokenError for a malformed entry, a variable that is
        not set, or a token too weak to guard a service."""
        fallback = read_text(env, registry.KEEL_TOOL_TOKEN)
        if fallback:
            weakness = secret_weakness(FALLBACK_VARIABLE, fallback)
            if weakness is not None:
                raise ToolTokenError(weakness)
        return cls(fallback, parse_tool_tokens(read_text(env, registry.KEEL_TOOL_TOKENS), env))

    def for_target(self, tenant_id: str, target: str) -> str:
        """The token to send to `target` for `tenant_id` ("" = none)."""
        parsed = grpc_target(target)
        address = None if parsed is None else (parsed[1], parsed[2])
        candidates: list[_Key] = [(tenant_id, None), (None, None)]
        if address is not None:
            candidates[:0] = [(tenant_id, address), (None, address)]
        for key in candidates:
            if key in self.specific:
                return self.specific[key]
        return self.fallback
