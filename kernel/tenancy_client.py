"""The kernel client's tenancy calls: tenants, API keys, loadouts, revocations.

The edge, `keel up` and the CLI's admin commands make these; runners only
read loadouts. They are plain requests and answers on the client's channel,
apart from the lease and runtime calls (kernel/client.py), which ride on
streams of their own; `KernelClient` takes them in as a base class.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from keel.kernel.v1 import kernel_pb2 as pb
from keel.kernel.v1 import kernel_pb2_grpc as pb_grpc
from kernel.codec import api_key_from_pb, revocation_from_pb, tenant_from_pb
from kernel.errors import KernelError
from kernel.tenancy import ApiKeyGrant, ApiKeyInfo, LoadoutRevision, Revocation, TenantInfo
from services.common.rpc import streaming, unary


class TenancyCalls:
    """create_tenant, create_api_key, authenticate, list_tenants,
    list_api_keys, revoke_api_key, watch_revocations, put_loadout and
    get_loadout."""

    # Set by KernelClient.__init__.
    _stub: pb_grpc.KernelServiceAsyncStub

    async def create_tenant(self, tenant_id: str, name: str = "") -> bool:
        """True if created, False if it already existed."""
        request = pb.CreateTenantRequest(tenant_id=tenant_id, name=name)
        response = await unary(self._stub.CreateTenant(request), KernelError)
        return response.created

    async def create_api_key(
        self, tenant_id: str, key: str = "", admin: bool = False, operator: bool = False
    ) -> tuple[str, str]:
        """(plain key, key id); the plain key is not stored and not shown again."""
        request = pb.CreateApiKeyRequest(
            tenant_id=tenant_id, key=key, admin=admin, operator=operator
        )
        response = await unary(self._stub.CreateApiKey(request), KernelError)
        return response.key, response.key_id

    async def authenticate(self, key: str) -> ApiKeyGrant:
        """What an API key may do (tenant, admin, operator); raises InvalidApiKey."""
        request = pb.AuthenticateRequest(key=key)
        response = await unary(self._stub.Authenticate(request), KernelError)
        return ApiKeyGrant(response.tenant_id, response.admin, response.operator, response.key_id)

    async def list_tenants(self) -> list[TenantInfo]:
        response = await unary(self._stub.ListTenants(pb.ListTenantsRequest()), KernelError)
        return [tenant_from_pb(t) for t in response.tenants]

    async def list_api_keys(self, tenant_id: str = "") -> list[ApiKeyInfo]:
        """A tenant's keys ("" = every tenant's): ids and rights, never the keys."""
        request = pb.ListApiKeysRequest(tenant_id=tenant_id)
        response = await unary(self._stub.ListApiKeys(request), KernelError)
        return [api_key_from_pb(k) for k in response.keys]

    async def revoke_api_key(self, key_id: str) -> bool:
        """True if this revoked the key, False if it already was; raises
        ApiKeyNotFound for an unknown id."""
        request = pb.RevokeApiKeyRequest(key_id=key_id)
        response = await unary(self._stub.RevokeApiKey(request), KernelError)
        return response.revoked

    async def watch_revocations(self, after_id: int = 0) -> AsyncIterator[Revocation]:
        """Revocations after `after_id`, then new ones as they are made; ends
        (or raises ServiceUnavailable) when the kernel goes away."""
        call = self._stub.WatchRevocations(pb.WatchRevocationsRequest(after_id=after_id))
        async for message in streaming(call, KernelError):
            yield revocation_from_pb(message)

    async def put_loadout(
        self, tenant_id: str, document: dict[str, Any], expected_revision: int = 0
    ) -> int:
        """Stores a new loadout revision; returns it (1, 2, 3 …). With
        `expected_revision`, only if that is still the latest (else
        RevisionMismatch)."""
        request = pb.PutLoadoutRequest(
            tenant_id=tenant_id,
            document_json=json.dumps(document, ensure_ascii=False),
            expected_revision=expected_revision,
        )
        response = await unary(self._stub.PutLoadout(request), KernelError)
        return response.revision

    async def get_loadout(self, tenant_id: str, revision: int = 0) -> LoadoutRevision:
        """Revision 0 = latest (revision 0 and the default document if none)."""
        request = pb.GetLoadoutRequest(tenant_id=tenant_id, revision=revision)
        response = await unary(self._stub.GetLoadout(request), KernelError)
        return LoadoutRevision(
            response.tenant_id, response.revision, json.loads(response.document_json)
        )
