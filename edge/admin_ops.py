"""What the edge does for tenant configuration: loadouts, tenants, API keys.

Both front doors (HTTP in edge/routes/admin.py, gRPC in edge/grpc_api.py)
call these, so who may do what is decided here once:

- a tenant's loadout: read and written by an admin key of that tenant;
- tenants: listed and created by operator keys (they run the deployment);
- keys: an operator manages any tenant's keys, operator keys included; a
  tenant's admin manages its own tenant's keys, never operator keys (an
  operator key affects every tenant). Another tenant's key or tenant is a
  404, as another tenant's session is: its existence is not revealed.

The kernel validates loadout documents; its refusal names the field, and
that name reaches the client in the error message. An empty document is
refused here, before the kernel is asked: it would store a revision that
silently resets the prompt, the model and the tools (an emptied editor
buffer, an empty file), so it aborts, as `kubectl edit` does. `null` for an
optional field is accepted and means "unset" (the default applies).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from edge.auth import Caller, require_operator
from edge.errors import BadRequest, Forbidden, NotFound, PreconditionFailed, shown
from edge.gateway import Gateway
from kernel import ApiKeyInfo
from kernel.errors import ApiKeyNotFound, InvalidLoadout, RevisionMismatch, UnknownTenant

# A tenant's id prefixes its sessions' ledger ids (`<tenant>:<id>`), so it
# has no ':'; the ledger's ids are at most 128 characters in all.
# Matched whole: `$` would also match before a trailing newline.
_TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
# The kernel's id alphabet (kernel.domain.check_id): key ids it makes are
# `key_<12 hex>`.
_KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}")
MAX_TENANT_NAME_CHARS = 256


class InvalidLoadoutDocument(BadRequest):
    """The loadout schema refused the document; the message names the field
    (and so does `metadata["field"]`, for the gRPC API's ErrorInfo)."""

    code = "invalid_loadout"
    reason = "INVALID_LOADOUT"


class LoadoutRevisionMismatch(PreconditionFailed):
    """If-Match (expected_revision) is no longer the latest revision."""

    reason = "REVISION_MISMATCH"


@dataclass(frozen=True)
class TenantInfo:
    tenant_id: str
    name: str
    created_at_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.tenant_id, "name": self.name, "createdAtMs": self.created_at_ms}


@dataclass(frozen=True)
class KeyInfo:
    """An API key as its managers see it: never the key itself."""

    key_id: str
    tenant_id: str
    admin: bool
    operator: bool
    created_at_ms: int
    # None while the key is valid.
    revoked_at_ms: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.key_id,
            "tenant": self.tenant_id,
            "admin": self.admin,
            "operator": self.operator,
            "createdAtMs": self.created_at_ms,
            "revokedAtMs": self.revoked_at_ms,
        }


# ------------------------------------------------------------------ loadout


def _require_tenant_admin(caller: Caller) -> None:
    if not caller.admin:
        raise Forbidden("the loadout needs an admin key of the tenant")


async def get_loadout(gw: Gateway, caller: Caller) -> tuple[int, dict[str, Any]]:
    """The caller's tenant's latest loadout: (revision, document); revision 0
    and the default document when the tenant never stored one."""
    _require_tenant_admin(caller)
    loadout = await gw.kernel.get_loadout(caller.tenant_id)
    return loadout.revision, loadout.document


async def put_loadout(
    gw: Gateway, caller: Caller, document: Any, expected_revision: int = 0
) -> int:
    """Stores `document` as the tenant's next revision and returns it.
    With `expected_revision` > 0 the put happens only if that is still the
    latest revision (a read-modify-write that lost a race is refused)."""
    _require_tenant_admin(caller)
    if document is None or document == {}:
        raise InvalidLoadoutDocument(
            "the loadout document is empty; nothing was stored (an empty document would "
            "reset the prompt, the model and the tools: to go back to the defaults, write "
            "them out)",
            field="document",
        )
    if not isinstance(document, dict):
        raise InvalidLoadoutDocument(
            "a loadout is an object (a mapping of fields)", field="document"
        )
    if expected_revision < 0:
        raise BadRequest("the expected revision must be >= 0", field="expected_revision")
    try:
        return await gw.kernel.put_loadout(
            caller.tenant_id, document, expected_revision=expected_revision
        )
    except InvalidLoadout as error:
        field = error.metadata.get("field", "")
        message = error.message
        # The field leads the message so a one-line display still names it.
        if field and field not in message:
            message = f"{field}: {message}"
        raise InvalidLoadoutDocument(message, field=field) from None
    except RevisionMismatch as error:
        current = error.metadata.get("current_revision")
        now = f" (it is {current})" if current else ""
        raise LoadoutRevisionMismatch(
            f"the loadout is no longer at revision {expected_revision}{now}; "
            "read it again and reapply your change"
        ) from None


# ------------------------------------------------------------------ tenants


async def list_tenants(gw: Gateway, caller: Caller) -> list[TenantInfo]:
    require_operator(caller)
    tenants = await gw.kernel.list_tenants()
    return [TenantInfo(t.tenant_id, t.name, t.created_at_ms) for t in tenants]


async def create_tenant(gw: Gateway, caller: Caller, tenant_id: Any, name: Any = "") -> bool:
    """True if created, False if a tenant with this id existed already."""
    require_operator(caller)
    if not isinstance(tenant_id, str) or not _TENANT_ID.fullmatch(tenant_id):
        raise BadRequest(
            f"id: a tenant id is 1-64 letters, digits or '_.-', got {shown(tenant_id)}",
            field="id",
        )
    if not isinstance(name, str) or len(name) > MAX_TENANT_NAME_CHARS:
        raise BadRequest(
            f"name: a string of at most {MAX_TENANT_NAME_CHARS} characters", field="name"
        )
    return await gw.kernel.create_tenant(tenant_id, name)


# ------------------------------------------------------------------ keys


def _key_info(key: ApiKeyInfo) -> KeyInfo:
    return KeyInfo(
        key.key_id,
        key.tenant_id,
        key.admin,
        key.operator,
        key.created_at_ms,
        key.revoked_at_ms or None,
    )


def _managed_tenant(caller: Caller, tenant: str | None) -> str:
    """The tenant whose keys a non-operator caller asks about: its own only."""
    if not caller.admin:
        raise Forbidden("managing keys needs an admin or operator key")
    if tenant not in (None, "", caller.tenant_id):
        raise NotFound("no such tenant")
    return caller.tenant_id


async def list_keys(gw: Gateway, caller: Caller, tenant: str | None = None) -> list[KeyInfo]:
    """The keys of `tenant` (None: an operator sees every tenant's, an admin
    its own tenant's)."""
    wanted = (tenant or "") if caller.operator else _managed_tenant(caller, tenant)
    keys = [_key_info(k) for k in await gw.kernel.list_api_keys(wanted)]
    if caller.operator and wanted and not keys:
        # A tenant without keys and no tenant at all look alike here.
        known = {t.tenant_id for t in await gw.kernel.list_tenants()}
        if wanted not in known:
            raise NotFound("no such tenant")
    return keys


async def create_key(
    gw: Gateway,
    caller: Caller,
    tenant: str | None = None,
    admin: bool = False,
    operator: bool = False,
) -> tuple[str, str]:
    """A new key of `tenant` (default: the caller's): (key id, the key).
    The key is returned this once; the kernel keeps only its hash."""
    if caller.operator:
        target = tenant or caller.tenant_id
    else:
        target = _managed_tenant(caller, tenant)
        if operator:
            raise Forbidden("only an operator key may create operator keys")
    try:
        key, key_id = await gw.kernel.create_api_key(target, admin=admin, operator=operator)
    except UnknownTenant:
        raise NotFound("no such tenant") from None
    return key_id, key


async def revoke_key(gw: Gateway, caller: Caller, key_id: str) -> bool:
    """Revokes a key at once on every edge. True if this call revoked it,
    False if it was revoked before. Another tenant's key is a 404."""
    if not _KEY_ID.fullmatch(key_id):
        raise BadRequest(f"{shown(key_id)} is not a key id", field="keyId")
    scope = "" if caller.operator else _managed_tenant(caller, None)
    found = next((k for k in await gw.kernel.list_api_keys(scope) if k.key_id == key_id), None)
    if found is None:
        raise NotFound("no such key")
    if found.operator and not caller.operator:
        raise Forbidden("only an operator key may revoke an operator key")
    try:
        return await gw.kernel.revoke_api_key(key_id)
    except ApiKeyNotFound:
        raise NotFound("no such key") from None
