"""Tenants and keys through the kernel's gRPC API: listing, revoking, the
revocation watch (backlog, live, and across kernel replicas), and loadout
puts that are validated and may expect a revision."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kernel import (
    ApiKeyExists,
    ApiKeyGrant,
    ApiKeyNotFound,
    InvalidApiKey,
    InvalidLoadout,
    KernelClient,
    KernelServer,
    RevisionMismatch,
    Revocation,
    UnknownTenant,
)
from kernel.tenancy import hash_key
from services.common.config import Settings
from tests.support.kernel_stores import FAST

# A safety net for awaiting something that must happen; never a measurement.
DEADLINE_S = 20.0


async def next_revocation(watch: AsyncIterator[Revocation]) -> Revocation:
    async with asyncio.timeout(DEADLINE_S):
        return await anext(watch)


async def test_tenants_and_their_keys_are_listed_without_the_keys(client: KernelClient) -> None:
    assert await client.create_tenant("acme", "Acme Inc.")
    assert await client.create_tenant("beta")
    admin_key, admin_id = await client.create_api_key("acme", admin=True)
    _, user_id = await client.create_api_key("acme")
    _, operator_id = await client.create_api_key("beta", operator=True)

    tenants = {t.tenant_id: t for t in await client.list_tenants()}
    assert {"acme", "beta"} <= set(tenants)
    assert tenants["acme"].name == "Acme Inc." and tenants["acme"].created_at_ms > 0

    acme = await client.list_api_keys("acme")
    assert {k.key_id for k in acme} == {admin_id, user_id}
    by_id = {k.key_id: k for k in await client.list_api_keys()}
    assert {admin_id, user_id, operator_id} <= set(by_id)
    assert by_id[admin_id].admin and not by_id[admin_id].operator
    assert by_id[operator_id].operator and by_id[operator_id].tenant_id == "beta"
    assert all(k.revoked_at_ms == 0 and k.created_at_ms > 0 for k in by_id.values())
    assert admin_key not in repr(by_id)
    with pytest.raises(UnknownTenant):
        await client.list_api_keys("ghost")


async def test_a_revoked_key_fails_at_once_and_stays_revoked(client: KernelClient) -> None:
    await client.create_tenant("acme")
    key, key_id = await client.create_api_key("acme", "acme-fixed-key-0123456789abc", admin=True)
    other, _ = await client.create_api_key("acme")
    grant = await client.authenticate(key)
    assert grant == ApiKeyGrant("acme", admin=True)
    assert grant.key_id == key_id, "the grant names the key (for audit), never the key itself"

    assert await client.revoke_api_key(key_id) is True
    with pytest.raises(InvalidApiKey):
        await client.authenticate(key)
    assert await client.revoke_api_key(key_id) is False
    [listed] = [k for k in await client.list_api_keys("acme") if k.key_id == key_id]
    assert listed.revoked_at_ms > 0
    # Registering the same fixed key again must not undo the revocation.
    with pytest.raises(ApiKeyExists):
        await client.create_api_key("acme", "acme-fixed-key-0123456789abc", admin=True)
    with pytest.raises(InvalidApiKey):
        await client.authenticate(key)
    # Only that key: the tenant's others still work.
    assert (await client.authenticate(other)).tenant_id == "acme"
    with pytest.raises(ApiKeyNotFound):
        await client.revoke_api_key("key_nonexistent")


async def test_the_watch_sends_the_backlog_then_each_new_revocation(
    client: KernelClient,
) -> None:
    await client.create_tenant("acme")
    keys = [await client.create_api_key("acme") for _ in range(4)]
    for _, key_id in keys[:2]:
        assert await client.revoke_api_key(key_id)

    watch = client.watch_revocations()
    first, second = await next_revocation(watch), await next_revocation(watch)
    assert [first.key_hash, second.key_hash] == [hash_key(k) for k, _ in keys[:2]]
    assert 0 < first.revocation_id < second.revocation_id

    # Live: revoked after the backlog was sent, through the same kernel.
    assert await client.revoke_api_key(keys[2][1])
    live = await next_revocation(watch)
    assert live.key_hash == hash_key(keys[2][0]) and live.revocation_id > second.revocation_id
    await watch.aclose()

    # Resuming after an id gives exactly what came after it.
    assert await client.revoke_api_key(keys[3][1])
    resumed = client.watch_revocations(after_id=first.revocation_id)
    got = [await next_revocation(resumed) for _ in range(3)]
    assert [r.key_hash for r in got] == [hash_key(k) for k, _ in keys[1:]]
    await resumed.aclose()


async def test_revocations_through_another_replica_reach_the_watchers(
    pg_settings: Settings,
) -> None:
    """Replica B revokes; a watcher of replica A learns of it only from the
    shared table (A's own RevokeApiKey never ran)."""
    settings = pg_settings.with_overrides(lease_ms=600_000)
    first = await KernelServer(settings, config=FAST).start()
    second = await KernelServer(settings, config=FAST).start()
    try:
        async with (
            KernelClient(first.target, first.settings) as a,
            KernelClient(second.target, second.settings) as b,
        ):
            await a.create_tenant("acme")
            key, key_id = await a.create_api_key("acme")
            assert (await b.authenticate(key)).tenant_id == "acme"
            watch = a.watch_revocations()
            # The watch is open and past its (empty) backlog once a
            # revocation made through A itself arrives on it.
            _, marker_id = await a.create_api_key("acme")
            assert await a.revoke_api_key(marker_id)
            await next_revocation(watch)

            assert await b.revoke_api_key(key_id)
            revoked = await next_revocation(watch)
            assert revoked.key_hash == hash_key(key)
            with pytest.raises(InvalidApiKey):
                await a.authenticate(key)
            await watch.aclose()
    finally:
        await second.stop()
        await first.stop()


async def test_loadout_puts_are_validated_and_may_expect_a_revision(
    client: KernelClient,
) -> None:
    await client.create_tenant("acme")
    with pytest.raises(InvalidLoadout) as caught:
        await client.put_loadout("acme", {"model": {"provider": "gemini"}})
    assert caught.value.metadata["field"] == "model.provider"
    with pytest.raises(InvalidLoadout) as caught:
        await client.put_loadout(
            "acme", {"tools": [{"source": "grpc", "name": "b", "target": "b:1"}]}
        )
    # A ToolService target the operator has not allowed (closed by default).
    assert caught.value.metadata["field"] == "tools[0].target"
    assert "KEEL_TOOL_TARGETS" in caught.value.message

    assert await client.put_loadout("acme", {"systemPrompt": "one"}) == 1
    assert await client.put_loadout("acme", {"systemPrompt": "two"}, expected_revision=1) == 2
    with pytest.raises(RevisionMismatch) as mismatch:
        await client.put_loadout("acme", {"systemPrompt": "stale"}, expected_revision=1)
    assert mismatch.value.metadata["current_revision"] == "2"
    assert (await client.get_loadout("acme")).document == {"systemPrompt": "two"}
    # Without an expectation, a put always lands.
    assert await client.put_loadout("acme", {"systemPrompt": "three"}) == 3


async def test_the_admission_object_sets_the_limit(client: KernelClient) -> None:
    await client.register_runtime("r1")
    await client.create_tenant("acme")
    assert await client.put_loadout("acme", {"admission": {"maxConcurrentRuns": 1}}) == 1
    for n in range(3):
        await client.enqueue(f"s{n}", "acme", 1)
    assert await client.claim("r1") is not None
    assert await client.claim("r1", wait_ms=20) is None
    assert await client.put_loadout("acme", {"admission": {"maxConcurrentRuns": 2}}) == 2
    assert await client.claim("r1") is not None
