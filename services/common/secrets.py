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
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
RESERVED_PREFIX = "KEEL_"
DEFAULT_PROVIDER_ORIGINS = ("https://api.openai.com", "https://api.anthropic.com")
_DEFAULT_PORTS = {"http": 80, "https": 443}


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


@dataclass(frozen=True)
class SecretPolicy:
    """The operator's rules for tenants' secrets and provider origins."""

    grants: Mapping[str, frozenset[str]] = field(default_factory=dict)
    provider_origins: tuple[str, ...] = DEFAULT_PROVIDER_ORIGINS

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SecretPolicy:
        return cls(
            parse_grants(env.get("KEEL_SECRET_GRANTS", "")),
            parse_origins(env.get("KEEL_PROVIDER_ORIGINS")),
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

    def with_grant(self, tenant_id: str, name: str) -> SecretPolicy:
        grants = dict(self.grants)
        grants[tenant_id] = grants.get(tenant_id, frozenset()) | {name}
        return SecretPolicy(grants, self.provider_origins)

    def with_origin(self, url: str) -> SecretPolicy:
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        if origin in self.provider_origins:
            return self
        return SecretPolicy(self.grants, (*self.provider_origins, origin))

    def to_env(self) -> dict[str, str]:
        """The variables that give a child process this same policy."""
        grants = ";".join(f"{t}={','.join(sorted(n))}" for t, n in sorted(self.grants.items()))
        return {
            "KEEL_SECRET_GRANTS": grants,
            "KEEL_PROVIDER_ORIGINS": ",".join(self.provider_origins),
        }


# The variable a model reads when its loadout names none.
DEFAULT_KEY_ENV: Mapping[str, str] = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
# Where a model without `baseUrl` is called (the SDKs' own defaults).
OFFICIAL_BASE_URL: Mapping[str, str] = {
    "openai": "https://api.openai.com/v1",
    "anthropic": "https://api.anthropic.com",
}
GRANTS_VARIABLE = "KEEL_SECRET_GRANTS"
ORIGINS_VARIABLE = "KEEL_PROVIDER_ORIGINS"


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
