"""Runner settings (frozen: a running runner never sees them change)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

SigtermMode = Literal["shutdown", "handoff"]


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
    # What SIGTERM means: abandon in-flight attempts, or hand them off.
    sigterm_mode: SigtermMode = "shutdown"
    handoff_deadline_ms: int = 30_000
    default_context_window: int = 128_000
    compaction_target: str = ""
    # Facts kept in memory between attempts, over all sessions (0: none).
    cached_facts: int = 100_000

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
        return cls(
            ledger_target=ledger_target,
            kernel_target=kernel_target,
            runtime_id=env.get("KEEL_RUNTIME_ID", ""),
            concurrency=int(env.get("KEEL_RUNNER_CONCURRENCY", "8")),
            claim_wait_ms=int(env.get("KEEL_CLAIM_WAIT_MS", "1000")),
            tool_timeout_s=float(env.get("KEEL_TOOL_TIMEOUT_S", "30")),
            sigterm_mode=mode,  # type: ignore[arg-type]
            default_context_window=int(env.get("KEEL_CONTEXT_WINDOW", "128000")),
            compaction_target=env.get("KEEL_COMPACTION_ADDRESS", ""),
            cached_facts=int(env.get("KEEL_RUNNER_CACHED_FACTS", "100000")),
        )
