"""Runner settings (frozen: a running runner never sees them change).

Tools: `KEEL_TOOL_TIMEOUT_S` is a call's timeout when its loadout source sets
no `timeoutMs` (default 60 s); `KEEL_TOOL_MAX_RESULT_BYTES` the most a tool
result may hold before it is cut with a note (default 64 KiB; a source's
`maxResultBytes` may lower it, never raise it); `KEEL_TOOL_TOKEN` is sent to
gRPC ToolServices as `x-keel-tool-token` (a credential of its own: a tenant
chooses those targets, so Keel's internal token is never sent to them), and
`KEEL_TOOL_TOKENS` gives a target or a tenant a token of its own
(agent_io.tools.tool_tokens). The
operator's policy on tool commands and targets is part of the shared
settings (services.common.secrets: `KEEL_MCP_COMMANDS`, `KEEL_TOOL_TARGETS`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from agent_io.tools.base import DEFAULT_MAX_RESULT_BYTES, DEFAULT_TOOL_TIMEOUT_S
from agent_io.tools.tool_tokens import ToolTokens
from services.common import settings_registry as registry
from services.common.setting import (
    int_default,
    read_choice,
    read_int,
    read_millis,
    read_number,
    read_text,
)

SigtermMode = Literal["shutdown", "handoff"]
DEFAULT_DRAIN_DEADLINE_MS = int_default(registry.KEEL_DRAIN_DEADLINE_MS)
# How long a runner keeps a session after answering (KEEL_STICKY_MS; 0: not
# at all): its next input within this window skips the claim, the new epoch
# and its fence fact. Long enough for a person's next message in a running
# conversation; short enough that an idle runner lets its sessions go soon.
# An idle window holds no run slot, only a route entry at the kernel and the
# session's facts the runner's cache keeps anyway.
DEFAULT_STICKY_MS = int_default(registry.KEEL_STICKY_MS)


@dataclass(frozen=True)
class RunnerConfig:
    ledger_target: str
    kernel_target: str
    runtime_id: str = ""
    # Attempts this runner works on at once.
    concurrency: int = 8
    # Long-poll of one Claim call.
    claim_wait_ms: int = 1000
    # A tool call's timeout when its source sets none (KEEL_TOOL_TIMEOUT_S).
    tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    # The most a tool result holds before it is cut (KEEL_TOOL_MAX_RESULT_BYTES).
    tool_max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    # Sent to gRPC ToolServices (KEEL_TOOL_TOKENS, else KEEL_TOOL_TOKEN).
    tool_tokens: ToolTokens = field(default_factory=ToolTokens, repr=False)
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
    # The sticky window asked for after each answered turn (KEEL_STICKY_MS).
    sticky_ms: int = DEFAULT_STICKY_MS
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
        mode = read_choice(env, registry.KEEL_SIGTERM_MODE)
        deadline = drain_deadline_ms(env)
        return cls(
            ledger_target=ledger_target,
            kernel_target=kernel_target,
            runtime_id=read_text(env, registry.KEEL_RUNTIME_ID),
            concurrency=read_int(env, registry.KEEL_RUNNER_CONCURRENCY),
            claim_wait_ms=read_int(env, registry.KEEL_CLAIM_WAIT_MS),
            tool_timeout_s=read_number(env, registry.KEEL_TOOL_TIMEOUT_S),
            tool_max_result_bytes=int(read_number(env, registry.KEEL_TOOL_MAX_RESULT_BYTES)),
            tool_tokens=ToolTokens.from_env(env),
            sigterm_mode=mode,  # type: ignore[arg-type]
            handoff_deadline_ms=deadline,
            default_context_window=read_int(env, registry.KEEL_CONTEXT_WINDOW),
            compaction_target=read_text(env, registry.KEEL_COMPACTION_ADDRESS),
            cached_facts=read_int(env, registry.KEEL_RUNNER_CACHED_FACTS),
            sticky_ms=read_millis(env, registry.KEEL_STICKY_MS),
            advertise_address=read_text(env, registry.KEEL_ADVERTISE_ADDRESS),
        )


def drain_deadline_ms(env: Mapping[str, str] | None = None) -> int:
    """KEEL_DRAIN_DEADLINE_MS: the handoff deadline of a runner's SIGTERM and
    the default of `keel drain`; 30 s when unset."""
    env = os.environ if env is None else env
    return read_millis(env, registry.KEEL_DRAIN_DEADLINE_MS)
