"""The kernel's own knobs, beyond the shared `Settings` (which owns the TTL).

Frozen, read once from `KEEL_*` variables; tests build their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kernel.domain import RetryPolicy
from services.common import settings_registry as registry
from services.common.setting import read_int, read_millis


@dataclass(frozen=True)
class KernelConfig:
    # Consecutive failed attempts after which a session is parked.
    max_attempts: int = 5
    # Backoff after the n-th consecutive failure: base * 2^(n-1), capped.
    backoff_base_ms: int = 1_000
    backoff_cap_ms: int = 60_000
    # Consecutive rate-limited attempts (a provider's 429 or 529) after which
    # a session is parked. They do not count toward max_attempts: a throttled
    # provider is not the session's fault. Each waits at least the
    # provider's retry-after, and at least the backoff of its count.
    max_rate_limited: int = 20
    # The longest wait a provider's retry-after is honoured for.
    retry_after_cap_ms: int = 900_000
    # How often owing sessions are re-read from the ledger (lost wake-ups).
    reconcile_ms: int = 5_000
    # How often due schedules are looked for (a firing is at most this late).
    schedule_tick_ms: int = 1_000
    # A session the reconciler finds owing but neither queued nor leased is
    # enqueued at once, and warned about only when nothing was committed to
    # it for this long: younger ones are answers or wake-ups still landing.
    reconcile_grace_ms: int = 10_000
    # A waiting claim re-checks the store this often even without a wake-up,
    # so work made runnable by another kernel replica (or by the clock:
    # backoff ending) is seen without an in-process event.
    recheck_ms: int = 500
    # How often leases past their TTL are expired; 0 = a tenth of the TTL,
    # between 50 ms and 1 s.
    sweep_ms: int = 0
    # A message on every Attach stream this often, so a dead peer's
    # connection is written to (and found broken) even when idle.
    attach_heartbeat_ms: int = 2_000
    # A runtime detached (or never attached) this long, holding no lease, is
    # forgotten, or `status` would list every pod that ever ran. A forgotten
    # runtime's Attach is refused, so this outlasts any partition a live
    # runtime should survive; and it is at least a second, so a runtime is
    # never forgotten between its Register and its Attach.
    runtime_retention_ms: int = 3_600_000
    # Each kernel writes a heartbeat this often for every runtime attached to
    # it, and looks for runtimes whose heartbeat stopped (kernel.liveness).
    runtime_heartbeat_ms: int = 1_000
    # A runtime marked attached whose heartbeat is older than this (on the
    # database's clock) died with its kernel: any kernel expires its leases.
    # Several heartbeats long, so a live kernel's slow write is not a death.
    runtime_dead_after_ms: int = 3_000

    def __post_init__(self) -> None:
        if self.runtime_dead_after_ms < 2 * self.runtime_heartbeat_ms:
            raise ValueError(
                "KEEL_RUNTIME_DEAD_AFTER_MS must be at least twice KEEL_RUNTIME_HEARTBEAT_MS "
                f"({self.runtime_dead_after_ms} < 2 * {self.runtime_heartbeat_ms})"
            )

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            self.max_attempts,
            self.backoff_base_ms,
            self.backoff_cap_ms,
            self.max_rate_limited,
            self.retry_after_cap_ms,
        )

    def sweep_interval_ms(self, lease_ms: int) -> int:
        if self.sweep_ms > 0:
            return self.sweep_ms
        return max(50, min(1_000, lease_ms // 10))

    @property
    def prune_interval_ms(self) -> int:
        # Forgetting is not urgent: once a minute is plenty, unless the
        # retention itself is shorter.
        return min(60_000, self.runtime_retention_ms)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KernelConfig:
        env = os.environ if env is None else env
        return cls(
            max_attempts=read_int(env, registry.KEEL_MAX_ATTEMPTS),
            backoff_base_ms=read_millis(env, registry.KEEL_BACKOFF_BASE_MS),
            backoff_cap_ms=read_millis(env, registry.KEEL_BACKOFF_CAP_MS),
            max_rate_limited=read_int(env, registry.KEEL_MAX_RATE_LIMITED),
            retry_after_cap_ms=read_millis(env, registry.KEEL_RETRY_AFTER_CAP_MS),
            reconcile_ms=read_millis(env, registry.KEEL_RECONCILE_MS),
            reconcile_grace_ms=read_millis(env, registry.KEEL_RECONCILE_GRACE_MS),
            recheck_ms=read_millis(env, registry.KEEL_CLAIM_RECHECK_MS),
            sweep_ms=read_millis(env, registry.KEEL_SWEEP_MS),
            attach_heartbeat_ms=read_millis(env, registry.KEEL_ATTACH_HEARTBEAT_MS),
            runtime_retention_ms=read_millis(env, registry.KEEL_RUNTIME_RETENTION_MS),
            runtime_heartbeat_ms=read_millis(env, registry.KEEL_RUNTIME_HEARTBEAT_MS),
            runtime_dead_after_ms=read_millis(env, registry.KEEL_RUNTIME_DEAD_AFTER_MS),
        )
