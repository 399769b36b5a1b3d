"""Runner settings (frozen: a running runner never sees them change)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

SigtermMode = Literal["shutdown", "handoff"]
DEFAULT_DRAIN_DEADLINE_MS = 30_000


@dataclass(frozen=True)
class RunnerConfig:
    ledger_target: str
    kernel_target: str
    runtime_id: str = ""
    # Attempts this runner works on at once.
    concurrency: int = 8
    # Long-poll of one Claim call.
    claim_wait_ms: int = 1000
    tool_timeout_s: float = 30.0
    # What SIGTERM means: stop in-flight attempts where they are, or hand
    # them off at their next commit boundary.
    sigterm_mode: SigtermMode = "shutdown"
    # How long a handoff drain waits for commit boundaries (SIGTERM, and a
    # Drain call that names no deadline); KEEL_DRAIN_DEADLINE_MS.
    handoff_deadline_ms: int = DEFAULT_DRAIN_DEADLINE_MS
    default_context_window: int = 128_000
    compaction_target: str = ""
    # Facts kept in memory between attempts, over all sessions (0: none).
    cached_facts: int = 100_000
    # The host:port other services dial to reach this runner, when it differs
    # from the address it listens on (KEEL_ADVERTISE_ADDRESS; required when
    # that address is a wildcard such as 0.0.0.0).
    advertise_address: str = ""

    def resolved_runtime_id(self) -> str:
        return self.runtime_id or f"rt-{uuid.uuid4().hex[:12]}"

    @classmethod
    def from_env(
        cls, ledger_target: str, kernel_target: str, env: Mapping[str, str] | None = None
    ) -> RunnerConfig:
        env = os.environ if env is None else env
        mode = env.get("KEEL_SIGTERM_MODE", "shutdown")
        if mode not in ("shutdown", "handoff"):
            raise ValueError(f"KEEL_SIGTERM_MODE must be shutdown or handoff, got {mode!r}")
        deadline = drain_deadline_ms(env)
        return cls(
            ledger_target=ledger_target,
            kernel_target=kernel_target,
            runtime_id=env.get("KEEL_RUNTIME_ID", ""),
            concurrency=int(env.get("KEEL_RUNNER_CONCURRENCY", "8")),
            claim_wait_ms=int(env.get("KEEL_CLAIM_WAIT_MS", "1000")),
            tool_timeout_s=float(env.get("KEEL_TOOL_TIMEOUT_S", "30")),
            sigterm_mode=mode,  # type: ignore[arg-type]
            handoff_deadline_ms=deadline,
            default_context_window=int(env.get("KEEL_CONTEXT_WINDOW", "128000")),
            compaction_target=env.get("KEEL_COMPACTION_ADDRESS", ""),
            cached_facts=int(env.get("KEEL_RUNNER_CACHED_FACTS", "100000")),
            advertise_address=env.get("KEEL_ADVERTISE_ADDRESS", ""),
        )


def drain_deadline_ms(env: Mapping[str, str] | None = None) -> int:
    """KEEL_DRAIN_DEADLINE_MS: the handoff deadline of a runner's SIGTERM and
    the default of `keel drain`; 30 s when unset."""
    env = os.environ if env is None else env
    raw = env.get("KEEL_DRAIN_DEADLINE_MS", "")
    if not raw:
        return DEFAULT_DRAIN_DEADLINE_MS
    if not raw.isascii() or not raw.isdigit():
        raise ValueError(f"KEEL_DRAIN_DEADLINE_MS must be a number of milliseconds, got {raw!r}")
    return int(raw)
