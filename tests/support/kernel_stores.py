"""The kernel's stores on a clock the test moves, and a kernel config of short intervals."""

from __future__ import annotations

from dataclasses import dataclass

from kernel import KernelConfig
from kernel.database import Database
from kernel.domain import RetryPolicy
from kernel.registry import Registration, RegistryStore
from kernel.store import LeaseStore
from kernel.tenancy import TenantStore
from services.common.config import Settings
from services.common.turn_settlement import FUNCTION

# Short everything, so tests wait on events and tiny intervals, never on defaults.
FAST = KernelConfig(
    max_attempts=3,
    backoff_base_ms=1,
    backoff_cap_ms=4,
    reconcile_ms=100,
    recheck_ms=50,
    sweep_ms=20,
    attach_heartbeat_ms=200,
)
# A claim is woken by an event only: the periodic re-check never fires.
NO_RECHECK = KernelConfig(recheck_ms=600_000, sweep_ms=20, attach_heartbeat_ms=200)


# The ledger's call of the kernel's turn settlement (kernel/turn_settlement.py),
# as its insert statement makes it, for tests that call it on a store's
# database: parallel arrays of sessions, epochs, runtimes, read_through and
# sticky_ms, then the time.
SETTLE = (
    f"SELECT settled_session, settled_until_ms FROM {FUNCTION}("
    "%s::text[], %s::bigint[], %s::text[], %s::bigint[], %s::bigint[], %s::bigint)"
)

# Long enough that only an explicit expiry (never the TTL) can end a lease.
LONG_TTL_MS = 600_000


class FakeClock:
    def __init__(self, start: int = 1_000_000) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


@dataclass
class Stores:
    database: Database
    leases: LeaseStore
    registry: RegistryStore
    tenants: TenantStore
    clock: FakeClock

    def register(self, *runtime_ids: str) -> None:
        for runtime_id in runtime_ids:
            self.registry.register(Registration(runtime_id, pid=1))


def open_stores(
    settings: Settings, lease_ms: int = 1_000, policy: RetryPolicy | None = None
) -> Stores:
    clock = FakeClock()
    database = Database(settings)
    return Stores(
        database=database,
        leases=LeaseStore(database, lease_ms, policy or RetryPolicy(3, 100, 400), clock=clock),
        registry=RegistryStore(database, clock),
        tenants=TenantStore(database, clock),
        clock=clock,
    )
