"""The lease store on both backends, with a controllable clock."""

from __future__ import annotations

import pytest

from kernel.database import Database
from kernel.domain import DrainMode
from kernel.errors import (
    ApiKeyExists,
    EpochSuperseded,
    InvalidApiKey,
    InvalidArgument,
    LeaseLost,
    LoadoutNotFound,
    UnknownRuntime,
    UnknownSession,
    UnknownTenant,
)
from kernel.registry import Registration
from kernel.tenancy import ApiKeyGrant, hash_key
from services.common.config import Settings
from tests.support.kernel_stores import Stores
from tests.support.replicas import start_at_once

TTL = 1_000


def test_claims_take_the_oldest_runnable_session_with_a_new_epoch(stores: Stores) -> None:
    stores.register("r1")
    for n in range(3):
        stores.leases.enqueue(f"s{n}", "t1", 1, False)
        stores.clock.advance(1)
    claimed = [stores.leases.claim("r1") for _ in range(4)]
    assert [lease.session_id if lease else None for lease in claimed] == ["s0", "s1", "s2", None]
    assert all(lease.epoch == 1 and not lease.reclaimed for lease in claimed if lease)


def test_release_hands_back_without_reclaim(stores: Stores) -> None:
    stores.register("r1", "r2")
    stores.leases.enqueue("s1", "t1", 1, False)
    first = stores.leases.claim("r1")
    assert first is not None
    assert stores.leases.claim("r2") is None
    stores.leases.release("s1", first.epoch, "r1")
    info = stores.leases.get_lease("s1")
    assert info.lease is None and info.queued
    second = stores.leases.claim("r2")
    assert second is not None
    assert second.epoch == 2 and not second.reclaimed
    assert stores.leases.slots("t1") == (1, 8)
    assert stores.leases.metrics.totals().get("reclaims", 0) == 0


def test_ttl_expiry_is_reported_as_a_reclaim(stores: Stores) -> None:
    stores.register("r1", "r2")
    stores.leases.enqueue("s1", "t1", 1, False)
    first = stores.leases.claim("r1")
    assert first is not None
    stores.clock.advance(TTL - 1)
    assert stores.leases.sweep() == 0
    assert stores.leases.claim("r2") is None
    stores.clock.advance(1)
    with pytest.raises(LeaseLost):
        stores.leases.renew("s1", first.epoch, "r1")
    successor = stores.leases.claim("r2")
    assert successor is not None and successor.reclaimed and successor.epoch == 2
    record = stores.leases.record("s1")
    assert record is not None and record.expired_by == "ttl"
    with pytest.raises(EpochSuperseded):
        stores.leases.finish("s1", first.epoch, "r1", 1)
    assert stores.leases.metrics.totals()["expirations_ttl"] == 1


def test_disconnect_expires_only_that_runtimes_leases_at_once(stores: Stores) -> None:
    stores.register("r1", "r2", "r3")
    for n in range(3):
        stores.leases.enqueue(f"s{n}", "t1", 1, False)
    held_by_r1 = [stores.leases.claim("r1"), stores.leases.claim("r1")]
    other = stores.leases.claim("r2")
    assert other is not None and all(held_by_r1)
    freed = stores.leases.expire_runtime("r1")
    assert sorted(freed) == sorted(lease.session_id for lease in held_by_r1 if lease)
    assert stores.leases.slots("t1")[0] == 1
    taken = [stores.leases.claim("r3"), stores.leases.claim("r3")]
    assert all(lease is not None and lease.reclaimed for lease in taken)
    assert stores.leases.renew(other.session_id, other.epoch, "r2") > 0
    assert stores.leases.metrics.totals()["expirations_disconnect"] == 2


def test_a_slot_comes_back_on_every_path(stores: Stores) -> None:
    stores.register("r1")
    stores.tenants.create_tenant("t1", "")
    stores.tenants.put_loadout("t1", {"maxConcurrentRuns": 1})
    for n in range(6):
        stores.leases.enqueue(f"s{n}", "t1", 1, False)

    def hold() -> tuple[str, int]:
        lease = stores.leases.claim("r1")
        assert lease is not None
        assert stores.leases.claim("r1") is None, "the tenant has one slot"
        assert stores.leases.slots("t1") == (1, 1)
        return lease.session_id, lease.epoch

    session, epoch = hold()
    stores.leases.release(session, epoch, "r1")
    session, epoch = hold()
    stores.leases.finish(session, epoch, "r1", 1)
    session, epoch = hold()
    stores.leases.finish(session, epoch, "r1", 1, failed=True, error="boom")
    session, epoch = hold()
    stores.leases.expire_runtime("r1")
    session, epoch = hold()
    stores.clock.advance(TTL)
    stores.leases.sweep()
    hold()


def test_finish_requeues_only_for_a_newer_input(stores: Stores) -> None:
    stores.register("r1")
    stores.leases.enqueue("s1", "t1", 3, False)
    lease = stores.leases.claim("r1")
    assert lease is not None
    stores.leases.enqueue("s1", "t1", 4, False)
    result = stores.leases.finish("s1", lease.epoch, "r1", read_through=3)
    assert result.requeued
    again = stores.leases.claim("r1")
    assert again is not None and again.session_id == "s1" and not again.reclaimed
    result = stores.leases.finish("s1", again.epoch, "r1", read_through=4)
    assert not result.requeued
    assert stores.leases.claim("r1") is None
    info = stores.leases.get_lease("s1")
    assert not info.queued and info.lease is None


def test_failures_back_off_park_and_unpark(stores: Stores) -> None:
    stores.register("r1")
    stores.leases.enqueue("s1", "t1", 1, False)
    for failure in (1, 2):
        lease = stores.leases.claim("r1")
        assert lease is not None and lease.failures == failure - 1
        result = stores.leases.finish("s1", lease.epoch, "r1", 1, failed=True, error="provider")
        assert result.requeued and not result.parked
        assert result.not_before_ms == stores.clock.now + stores.leases.policy.backoff_ms(failure)
        assert stores.leases.claim("r1") is None, "backing off"
        stores.clock.now = result.not_before_ms
    lease = stores.leases.claim("r1")
    assert lease is not None
    result = stores.leases.finish("s1", lease.epoch, "r1", 1, failed=True, error="provider")
    assert result.parked and not result.requeued
    stores.clock.advance(10**6)
    assert stores.leases.claim("r1") is None
    stores.leases.enqueue("s1", "t1", 2, False)
    assert stores.leases.get_lease("s1").parked
    assert stores.leases.claim("r1") is None
    stores.leases.enqueue("s1", "t1", 2, unpark=True)
    lease = stores.leases.claim("r1")
    assert lease is not None and lease.failures == 0
    record = stores.leases.record("s1")
    # Parked, the record said why; unparking keeps it until the next outcome.
    assert record is not None and record.last_error == "gave up after 3 failed attempts: provider"


def test_a_draining_runtime_claims_nothing(stores: Stores) -> None:
    stores.register("r1")
    stores.leases.enqueue("s1", "t1", 1, False)
    for mode in (DrainMode.HANDOFF, DrainMode.SHUTDOWN):
        stores.registry.set_drain("r1", mode)
        assert stores.leases.claim("r1") is None
    stores.registry.set_drain("r1", DrainMode.NONE)
    assert stores.leases.claim("r1") is not None


def test_refusals(stores: Stores) -> None:
    stores.register("r1")
    with pytest.raises(UnknownRuntime):
        stores.leases.claim("ghost")
    with pytest.raises(UnknownRuntime):
        stores.registry.set_drain("ghost", DrainMode.HANDOFF)
    with pytest.raises(UnknownSession):
        stores.leases.renew("nobody", 1, "r1")
    stores.leases.enqueue("s1", "t1", 1, False)
    with pytest.raises(LeaseLost, match="never leased"):
        stores.leases.release("s1", 1, "r1")
    with pytest.raises(InvalidArgument):
        stores.leases.enqueue("s1", "another-tenant", 1, False)
    lease = stores.leases.claim("r1")
    assert lease is not None
    with pytest.raises(EpochSuperseded):
        stores.leases.renew("s1", lease.epoch + 1, "r1")
    with pytest.raises(LeaseLost):
        stores.leases.renew("s1", lease.epoch, "r2")
    assert stores.leases.get_lease("never-seen").lease is None


def test_slot_counters_are_recounted_at_start_up(stores: Stores) -> None:
    stores.register("r1")
    for n in range(3):
        stores.leases.enqueue(f"s{n}", "t1", 1, False)
    assert stores.leases.claim("r1") is not None
    stores.database.run(lambda tx: tx.execute("UPDATE kernel_slots SET in_use = 5"))
    assert stores.leases.reconcile_slots() == {"t1": (5, 1)}
    assert stores.leases.slots("t1") == (1, 8)
    assert stores.leases.reconcile_slots() == {}


def test_stranded_sessions_are_enqueued_once(stores: Stores) -> None:
    stores.register("r1")
    assert stores.leases.enqueue_if_stranded("s1", "t1")
    assert not stores.leases.enqueue_if_stranded("s1", "t1"), "already queued"
    lease = stores.leases.claim("r1")
    assert lease is not None
    stores.leases.finish("s1", lease.epoch, "r1", 0)
    assert stores.leases.enqueue_if_stranded("s1", "t1")
    lease = stores.leases.claim("r1")
    assert lease is not None
    assert not stores.leases.enqueue_if_stranded("s1", "t1"), "leased"


def test_tenants_keys_and_loadouts(stores: Stores) -> None:
    tenants = stores.tenants
    assert tenants.create_tenant("acme", "Acme")
    assert not tenants.create_tenant("acme", "Acme")
    key, key_id = tenants.create_api_key("acme", "", admin=False)
    assert key.startswith("keel_") and key_id.startswith("key_")
    assert tenants.authenticate(key) == ApiKeyGrant("acme", admin=False, operator=False)
    stored = stores.database.run(lambda tx: tx.rows("SELECT key_hash FROM api_keys"))
    assert stored == [(hash_key(key),)], "only the hash is stored"
    # A caller-chosen key (a fixed dev key) of the strength keys must have.
    dev_key = "dev-key-1-0123456789abcdef"
    dev, dev_id = tenants.create_api_key("acme", dev_key, admin=True)
    assert dev == dev_key
    assert tenants.create_api_key("acme", dev_key, admin=True) == (dev_key, dev_id)
    assert tenants.authenticate(dev_key) == ApiKeyGrant("acme", admin=True, operator=False)
    # Creating a known key again with other rights grants those rights.
    assert tenants.create_api_key("acme", dev_key, admin=True, operator=True)[1] == dev_id
    assert tenants.authenticate(dev_key) == ApiKeyGrant("acme", admin=True, operator=True)
    ops, _ = tenants.create_api_key("acme", "", admin=False, operator=True)
    assert tenants.authenticate(ops) == ApiKeyGrant("acme", admin=False, operator=True)
    tenants.create_tenant("other", "")
    with pytest.raises(ApiKeyExists):
        tenants.create_api_key("other", dev_key, admin=False)
    with pytest.raises(InvalidApiKey):
        tenants.authenticate("wrong")
    with pytest.raises(InvalidApiKey):
        tenants.authenticate("")
    with pytest.raises(UnknownTenant):
        tenants.create_api_key("ghost", "", admin=False)

    default = tenants.get_loadout("acme", 0)
    assert default.revision == 0 and default.document["maxConcurrentRuns"] == 8
    assert tenants.put_loadout("acme", {"maxConcurrentRuns": 2, "tools": []}) == 1
    assert tenants.put_loadout("acme", {"maxConcurrentRuns": 3}) == 2
    assert tenants.get_loadout("acme", 0).document == {"maxConcurrentRuns": 3}
    assert tenants.get_loadout("acme", 1).document == {"maxConcurrentRuns": 2, "tools": []}
    assert stores.leases.slots("acme") == (0, 3)
    with pytest.raises(LoadoutNotFound):
        tenants.get_loadout("acme", 7)
    with pytest.raises(UnknownTenant):
        tenants.get_loadout("ghost", 0)
    with pytest.raises(UnknownTenant):
        tenants.put_loadout("ghost", {})


def test_runtime_registry_and_handoffs(stores: Stores) -> None:
    registry = stores.registry
    registry.register(Registration("r1", "10.0.0.1:7000", host="h1", pid=11, version="1"))
    registry.register(Registration("r2", pid=12, role="edge"))
    registry.set_drain("r1", DrainMode.HANDOFF)
    # The same process re-registering keeps its drain; a new process does not.
    registry.register(Registration("r1", "10.0.0.1:7000", host="h1", pid=11, version="1"))
    stores.leases.enqueue("s1", "t1", 1, False)
    stores.leases.enqueue("s2", "t2", 1, False)
    assert stores.leases.claim("r2") is not None
    assert stores.leases.claim("r2") is not None
    runtimes = {r.runtime_id: r for r in registry.list_runtimes(stores.leases.held_by)}
    assert runtimes["r1"].drain_mode == "handoff"
    assert runtimes["r1"].address == "10.0.0.1:7000" and runtimes["r1"].pid == 11
    assert runtimes["r2"].session_ids == ("s1", "s2") and runtimes["r2"].role == "edge"
    assert runtimes["r2"].session_tenant_ids == ("t1", "t2")
    registry.register(Registration("r1", pid=99))
    runtimes = {r.runtime_id: r for r in registry.list_runtimes(stores.leases.held_by)}
    assert runtimes["r1"].drain_mode == "none"

    first = registry.record_handoff("r1", "r3", 2, 1, "s1", 4)
    second = registry.record_handoff("r3", "r4", 3, 0, "", 0)
    assert second > first
    newest = registry.list_handoffs(1)
    assert [h.handoff_id for h in newest] == [second]
    both = registry.list_handoffs(10)
    assert [h.old_runtime_id for h in both] == ["r3", "r1"]
    assert both[1].epoch == 4 and both[1].in_flight == 1 and both[1].session_id == "s1"


def test_replicas_starting_at_once_create_the_schema_safely(pg_settings: Settings) -> None:
    opened, errors = start_at_once(lambda: Database(pg_settings))
    try:
        assert not errors
        assert len(opened) == 4
    finally:
        for database in opened:
            database.close()
