"""Random interleavings of claim / renew / release / finish / expiry against
the real store (both backends, a controllable clock).

Whatever the order, the store must keep:
- one owner: a claim never hands out a session whose previous lease is
  still valid, and only the newest lease of a session is ever accepted;
- epochs that strictly increase per session;
- slot accounting: each tenant's counter equals its held leases and never
  exceeds its admission limit (so no path leaks or double-returns a slot).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kernel.domain import Lease
from kernel.errors import EpochSuperseded, KernelError, LeaseLost
from services.common.config import Settings
from tests.support.kernel_stores import Stores, open_stores

TTL = 1_000
LIMITS = {"ta": 2, "tb": 8}
SESSIONS = 5
RUNTIMES = 3

MACHINE_SETTINGS = settings(
    derandomize=True,
    database=None,
    max_examples=25,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@dataclass
class Issued:
    lease: Lease
    expires_at_ms: int
    # "", "release", "finish" or "disconnect".
    ended_by: str = ""


def lease_machine(stores: Stores) -> type[RuleBasedStateMachine]:
    class LeaseMachine(RuleBasedStateMachine):
        leases = Bundle("leases")

        @initialize()
        def fresh_ids(self) -> None:
            # One database per test; every example gets ids of its own.
            prefix = uuid.uuid4().hex[:8]
            self.tenants = {f"{prefix}-{name}": limit for name, limit in LIMITS.items()}
            tenant_ids = sorted(self.tenants)
            self.sessions = [f"{prefix}-s{i}" for i in range(SESSIONS)]
            self.tenant_of = {s: tenant_ids[i % 2] for i, s in enumerate(self.sessions)}
            self.runtimes = [f"{prefix}-r{i}" for i in range(RUNTIMES)]
            stores.register(*self.runtimes)
            for tenant_id, limit in self.tenants.items():
                stores.tenants.create_tenant(tenant_id, "")
                stores.tenants.put_loadout(tenant_id, {"maxConcurrentRuns": limit})
            self.latest: dict[str, Issued] = {}
            self.epochs: dict[str, int] = {}
            for session_id in self.sessions:
                stores.leases.enqueue(session_id, self.tenant_of[session_id], 1, False)

        def valid(self, issued: Issued) -> bool:
            lease = issued.lease
            return (
                self.latest.get(lease.session_id) is issued
                and not issued.ended_by
                and issued.expires_at_ms > stores.clock.now
            )

        @rule(index=st.integers(0, SESSIONS - 1), seq=st.integers(0, 5), unpark=st.booleans())
        def enqueue(self, index: int, seq: int, unpark: bool) -> None:
            session_id = self.sessions[index]
            stores.leases.enqueue(session_id, self.tenant_of[session_id], seq, unpark)

        @rule(target=leases, index=st.integers(0, RUNTIMES - 1))
        def claim(self, index: int) -> Issued | None:
            lease = stores.leases.claim(self.runtimes[index])
            if lease is None:
                return None
            previous = self.latest.get(lease.session_id)
            assert previous is None or not self.valid(previous), "two owners of one session"
            assert lease.epoch > self.epochs.get(lease.session_id, 0), "epoch did not increase"
            self.epochs[lease.session_id] = lease.epoch
            issued = Issued(lease, lease.expires_at_ms)
            self.latest[lease.session_id] = issued
            return issued

        def attempt(self, issued: Issued | None, op: str, call: Callable[[Lease], object]) -> None:
            if issued is None:
                return
            expected = self.valid(issued)
            if op == "release" and issued.ended_by == "release":
                # A retried release of the same lease is accepted (its reply
                # may have been lost), as long as nobody claimed since.
                expected = self.latest.get(issued.lease.session_id) is issued
            try:
                outcome = call(issued.lease)
            except (EpochSuperseded, LeaseLost):
                assert not expected, f"{op} of a valid lease was refused"
                return
            except KernelError as error:
                raise AssertionError(f"unexpected {error!r}") from error
            assert expected, f"{op} of an invalid lease was accepted"
            if op == "renew":
                assert isinstance(outcome, int)
                issued.expires_at_ms = outcome
            else:
                issued.ended_by = op

        @rule(issued=leases)
        def renew(self, issued: Issued | None) -> None:
            self.attempt(
                issued,
                "renew",
                lambda lease: stores.leases.renew(lease.session_id, lease.epoch, lease.runtime_id),
            )

        @rule(issued=leases)
        def release(self, issued: Issued | None) -> None:
            self.attempt(
                issued,
                "release",
                lambda lease: stores.leases.release(
                    lease.session_id, lease.epoch, lease.runtime_id
                ),
            )

        @rule(issued=leases, read_through=st.integers(0, 5), failed=st.booleans())
        def finish(self, issued: Issued | None, read_through: int, failed: bool) -> None:
            self.attempt(
                issued,
                "finish",
                lambda lease: stores.leases.finish(
                    lease.session_id, lease.epoch, lease.runtime_id, read_through, failed=failed
                ),
            )

        @rule(
            index=st.integers(0, SESSIONS - 1),
            op=st.sampled_from(["renew", "release", "finish"]),
            read_through=st.integers(0, 5),
            failed=st.booleans(),
        )
        def use_newest_lease(self, index: int, op: str, read_through: int, failed: bool) -> None:
            """Most bundle draws are old leases; this one is often still valid."""
            issued = self.latest.get(self.sessions[index])
            if op == "renew":
                self.renew(issued)
            elif op == "release":
                self.release(issued)
            else:
                self.finish(issued, read_through, failed)

        @rule(ms=st.sampled_from([1, 100, TTL // 2, TTL, TTL + 1, 3 * TTL]))
        def time_passes(self, ms: int) -> None:
            stores.clock.advance(ms)

        @rule()
        def sweep(self) -> None:
            stores.leases.sweep()

        @rule(index=st.integers(0, RUNTIMES - 1))
        def disconnect(self, index: int) -> None:
            runtime_id = self.runtimes[index]
            freed = set(stores.leases.expire_runtime(runtime_id))
            for issued in self.latest.values():
                if issued.lease.runtime_id == runtime_id and issued.lease.session_id in freed:
                    issued.ended_by = "disconnect"

        @invariant()
        def slots_match_held_leases(self) -> None:
            if not hasattr(self, "tenants"):
                return
            for tenant_id, limit in self.tenants.items():
                in_use, max_runs = stores.leases.slots(tenant_id)
                assert max_runs == limit
                assert in_use == stores.leases.held_count(tenant_id)
                assert 0 <= in_use <= limit

        @invariant()
        def valid_leases_are_what_the_store_holds(self) -> None:
            if not hasattr(self, "tenants"):
                return
            for session_id in self.sessions:
                record = stores.leases.record(session_id)
                issued = self.latest.get(session_id)
                if record is None:
                    assert issued is None
                    continue
                if issued is not None and self.valid(issued):
                    assert record.live(stores.clock.now)
                    assert record.epoch == issued.lease.epoch
                    assert record.runtime_id == issued.lease.runtime_id

    return LeaseMachine


def test_random_interleavings_keep_one_owner_and_exact_slots(settings: Settings) -> None:
    stores = open_stores(settings, lease_ms=TTL)
    try:
        machine = lease_machine(stores)
        machine.TestCase.settings = MACHINE_SETTINGS
        machine.TestCase().runTest()
    finally:
        stores.database.close()
