"""The kernel's tenancy calls: tenants, API keys, loadouts and key revocations.

They validate and hand over to the `TenantStore`; the only lease state they
touch is the end of a tenant's sticky windows when its loadout changes.
Apart from the servicer's runtime and lease calls (kernel.servicer), which
own the process's live state (Attach streams, waiting claims, wake routes):
these only read and write the tenants' tables, and the servicer takes them
in as a base class so its gRPC surface stays one class.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from keel.kernel.v1 import kernel_pb2 as pb
from kernel.codec import api_key_to_pb, revocation_to_pb, tenant_to_pb
from kernel.domain import check_id
from kernel.loadout_secrets import check_loadout_secrets
from kernel.revocations import RevocationFeed
from kernel.rpc_checks import Context, bounded_text, non_negative, optional_id
from kernel.store import LeaseStore
from kernel.tenancy import TenantStore, parse_document
from kernel.waker import ClaimWaker
from services.common.errors import stream_errors, unary_errors
from services.common.secrets import SecretPolicy


class TenancyRpcs:
    """CreateTenant, CreateApiKey, Authenticate, PutLoadout, GetLoadout,
    ListTenants, ListApiKeys, RevokeApiKey and WatchRevocations."""

    # Set by KernelServicer.__init__.
    _tenants: TenantStore
    _leases: LeaseStore
    _waker: ClaimWaker
    _secrets: SecretPolicy
    _revocations: RevocationFeed

    @unary_errors
    async def CreateTenant(
        self, request: pb.CreateTenantRequest, context: Context
    ) -> pb.CreateTenantResponse:
        tenant_id = check_id(request.tenant_id, "tenant_id")
        created = await asyncio.to_thread(
            self._tenants.create_tenant, tenant_id, bounded_text(request.name, "name", 256)
        )
        return pb.CreateTenantResponse(tenant_id=tenant_id, created=created)

    @unary_errors
    async def CreateApiKey(
        self, request: pb.CreateApiKeyRequest, context: Context
    ) -> pb.CreateApiKeyResponse:
        key, key_id = await asyncio.to_thread(
            self._tenants.create_api_key,
            check_id(request.tenant_id, "tenant_id"),
            request.key,
            request.admin,
            request.operator,
        )
        return pb.CreateApiKeyResponse(key=key, key_id=key_id)

    @unary_errors
    async def Authenticate(
        self, request: pb.AuthenticateRequest, context: Context
    ) -> pb.AuthenticateResponse:
        grant = await asyncio.to_thread(self._tenants.authenticate, request.key)
        return pb.AuthenticateResponse(
            tenant_id=grant.tenant_id,
            admin=grant.admin,
            operator=grant.operator,
            key_id=grant.key_id,
        )

    @unary_errors
    async def PutLoadout(
        self, request: pb.PutLoadoutRequest, context: Context
    ) -> pb.PutLoadoutResponse:
        tenant_id = check_id(request.tenant_id, "tenant_id")
        document = parse_document(request.document_json)
        check_loadout_secrets(document, tenant_id, self._secrets)
        expected = non_negative(request.expected_revision, "expected_revision")
        revision = await asyncio.to_thread(self._tenants.put_loadout, tenant_id, document, expected)
        # A runner keeping a session runs the loadout it had: the next input
        # is claimed afresh, with this revision.
        await asyncio.to_thread(self._leases.end_sticky, tenant_id=tenant_id)
        # A raised admission limit may let waiting sessions run now.
        self._waker.wake()
        return pb.PutLoadoutResponse(revision=revision)

    @unary_errors
    async def GetLoadout(
        self, request: pb.GetLoadoutRequest, context: Context
    ) -> pb.GetLoadoutResponse:
        tenant_id = check_id(request.tenant_id, "tenant_id")
        revision = non_negative(request.revision, "revision")
        loadout = await asyncio.to_thread(self._tenants.get_loadout, tenant_id, revision)
        return pb.GetLoadoutResponse(
            tenant_id=loadout.tenant_id,
            revision=loadout.revision,
            document_json=json.dumps(loadout.document, ensure_ascii=False),
        )

    @unary_errors
    async def ListTenants(
        self, request: pb.ListTenantsRequest, context: Context
    ) -> pb.ListTenantsResponse:
        tenants = await asyncio.to_thread(self._tenants.list_tenants)
        return pb.ListTenantsResponse(tenants=[tenant_to_pb(t) for t in tenants])

    @unary_errors
    async def ListApiKeys(
        self, request: pb.ListApiKeysRequest, context: Context
    ) -> pb.ListApiKeysResponse:
        keys = await asyncio.to_thread(
            self._tenants.list_api_keys, optional_id(request.tenant_id, "tenant_id")
        )
        return pb.ListApiKeysResponse(keys=[api_key_to_pb(k) for k in keys])

    @unary_errors
    async def RevokeApiKey(
        self, request: pb.RevokeApiKeyRequest, context: Context
    ) -> pb.RevokeApiKeyResponse:
        key_id = check_id(request.key_id, "key_id")
        revoked = await asyncio.to_thread(self._tenants.revoke_api_key, key_id)
        if revoked:
            self._revocations.notify()
        return pb.RevokeApiKeyResponse(revoked=revoked)

    @stream_errors
    async def WatchRevocations(
        self, request: pb.WatchRevocationsRequest, context: Context
    ) -> AsyncIterator[pb.WatchRevocationsResponse]:
        after_id = non_negative(request.after_id, "after_id")
        async for revocation in self._revocations.watch(after_id):
            yield revocation_to_pb(revocation)
