"""The kernel: who may work on which session, and since when.

It owns leases (owner runtime, attempt, epoch, expiry), the runnable queue,
per-tenant admission slots, the runtime registry with its audit
(`runtime_instances`, `handoffs`), and tenants with their API keys and
versioned loadouts. Runners claim sessions here; the ledger fences their
writes by the epoch the kernel issued.

Public surface::

    KernelClient, Attachment   typed async gRPC client (kernel.client)
    KernelServer, run_kernel   the service (embedded or standalone)
    KernelConfig               kernel knobs (KEEL_MAX_ATTEMPTS, KEEL_RECONCILE_MS…)
    Lease, LeaseInfo, FinishResult, RuntimeInfo, HandoffInfo, LoadoutRevision
    ApiKeyGrant                what an API key may do (tenant, admin, operator)
    TenantInfo, ApiKeyInfo, Revocation   listed tenants, keys, revoked key hashes
    validate_loadout           the loadout schema (SPEC §10; kernel.loadout)
    KernelError …              the error tree (see kernel.errors)

Leases may end early: when a runtime's Attach stream breaks, its leases are
expired at once (fast takeover). That is safe because the ledger, not the
kernel, is the fence — see the docstring of `kernel.expiry` for the argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kernel.client import Attachment, KernelClient
    from kernel.config import KernelConfig
    from kernel.domain import DEFAULT_LOADOUT, DrainMode, FinishResult, Lease, LeaseInfo
    from kernel.errors import (
        ApiKeyExists,
        ApiKeyNotFound,
        EpochSuperseded,
        InvalidApiKey,
        InvalidArgument,
        InvalidLoadout,
        KernelError,
        LeaseLost,
        LoadoutNotFound,
        RevisionMismatch,
        UnknownRuntime,
        UnknownSession,
        UnknownTenant,
    )
    from kernel.loadout import validate_loadout
    from kernel.registry import HandoffInfo, RuntimeInfo
    from kernel.server import KernelServer, run_kernel
    from kernel.tenancy import ApiKeyGrant, ApiKeyInfo, LoadoutRevision, Revocation, TenantInfo

__all__ = [
    "DEFAULT_LOADOUT",
    "ApiKeyExists",
    "ApiKeyGrant",
    "ApiKeyInfo",
    "ApiKeyNotFound",
    "Attachment",
    "DrainMode",
    "EpochSuperseded",
    "FinishResult",
    "HandoffInfo",
    "InvalidApiKey",
    "InvalidArgument",
    "InvalidLoadout",
    "KernelClient",
    "KernelConfig",
    "KernelError",
    "KernelServer",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "LoadoutNotFound",
    "LoadoutRevision",
    "RevisionMismatch",
    "Revocation",
    "RuntimeInfo",
    "TenantInfo",
    "UnknownRuntime",
    "UnknownSession",
    "UnknownTenant",
    "run_kernel",
    "validate_loadout",
]

# name -> the module that defines it, imported when the name is first read
# (services/common/lazy_exports.py).
_EXPORTS: dict[str, str] = {
    "Attachment": "kernel.client",
    "KernelClient": "kernel.client",
    "KernelConfig": "kernel.config",
    "DEFAULT_LOADOUT": "kernel.domain",
    "DrainMode": "kernel.domain",
    "FinishResult": "kernel.domain",
    "Lease": "kernel.domain",
    "LeaseInfo": "kernel.domain",
    "ApiKeyExists": "kernel.errors",
    "ApiKeyNotFound": "kernel.errors",
    "InvalidApiKey": "kernel.errors",
    "InvalidArgument": "kernel.errors",
    "InvalidLoadout": "kernel.errors",
    "KernelError": "kernel.errors",
    "LeaseLost": "kernel.errors",
    "LoadoutNotFound": "kernel.errors",
    "RevisionMismatch": "kernel.errors",
    "EpochSuperseded": "kernel.errors",
    "UnknownRuntime": "kernel.errors",
    "UnknownSession": "kernel.errors",
    "UnknownTenant": "kernel.errors",
    "validate_loadout": "kernel.loadout",
    "HandoffInfo": "kernel.registry",
    "RuntimeInfo": "kernel.registry",
    "KernelServer": "kernel.server",
    "run_kernel": "kernel.server",
    "ApiKeyGrant": "kernel.tenancy",
    "ApiKeyInfo": "kernel.tenancy",
    "LoadoutRevision": "kernel.tenancy",
    "Revocation": "kernel.tenancy",
    "TenantInfo": "kernel.tenancy",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
