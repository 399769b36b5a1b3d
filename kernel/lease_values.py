"""What the kernel knows of a session's lease, as values: its record and states,
the leases and answers handed out, and a transition from one record to the next.

These are the nouns of kernel/domain.py, whose functions are the rules that
move a record from one state to the next. They are apart from the rules
because every part of the kernel (the store, the codec, the client, the
metrics) passes them around while only the store applies the rules;
kernel.domain re-exports them, so callers name them there as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class LeaseState(StrEnum):
    FREE = "free"
    HELD = "held"
    RELEASED = "released"
    FINISHED = "finished"
    EXPIRED = "expired"
    # Finished, kept by its runner for a window (`expires_at_ms` ends it).
    STICKY = "sticky"


class ExpiredBy(StrEnum):
    TTL = "ttl"
    # The owner's Attach stream ended: fast takeover (see kernel.expiry).
    DISCONNECT = "disconnect"


class DrainMode(StrEnum):
    NONE = "none"
    HANDOFF = "handoff"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class Lease:
    session_id: str
    tenant_id: str
    runtime_id: str
    attempt_id: str
    epoch: int
    expires_at_ms: int
    # The previous lease expired (TTL or owner disconnect) instead of being
    # released or finished: the successor is recovering from a crash.
    reclaimed: bool
    # Consecutive failed attempts before this claim.
    failures: int
    # Consecutive rate-limited attempts before this claim.
    rate_limits: int = 0


@dataclass(frozen=True)
class FinishResult:
    requeued: bool
    parked: bool
    not_before_ms: int
    # Why the session was parked ("" unless parked).
    parked_reason: str = ""
    # The end of the sticky window granted (0: none).
    sticky_until_ms: int = 0
    # A window was asked for but a newer input came first: still held, go on.
    continued: bool = False


@dataclass(frozen=True)
class LeaseInfo:
    # The live lease, or None when nobody may write to the session now.
    lease: Lease | None
    # The session owes work (stays true while a lease runs it).
    queued: bool
    # Too many consecutive failures: not claimable until unparked.
    parked: bool
    # Why the last attempts failed, and when the next may start.
    failures: int = 0
    rate_limits: int = 0
    not_before_ms: int = 0
    # The last failure's error; once parked, why it was parked.
    last_error: str = ""


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    tenant_id: str
    # Owes work: set by enqueue, cleared only by a finish with nothing newer.
    # A held session stays queued (it is not claimable while the lease lives).
    queued: bool = False
    parked: bool = False
    # Newest input seq announced by Enqueue (the max ever seen).
    input_seq: int = 0
    # Not claimable before this time (backoff after a failed attempt).
    not_before_ms: int = 0
    # When the session last became runnable: queue order and queue wait.
    queued_at_ms: int = 0
    state: LeaseState = LeaseState.FREE
    # The current or last holder.
    runtime_id: str = ""
    attempt_id: str = ""
    epoch: int = 0
    expires_at_ms: int = 0
    claimed_at_ms: int = 0
    expired_by: str = ""
    failures: int = 0
    last_error: str = ""
    # Consecutive rate-limited attempts (they do not count as failures).
    rate_limits: int = 0

    def live(self, now_ms: int) -> bool:
        """A lease is in force: its holder may write, nobody else may claim."""
        return self.state is LeaseState.HELD and self.expires_at_ms > now_ms

    def claimable(self, now_ms: int) -> bool:
        return (
            self.queued
            and not self.parked
            and self.not_before_ms <= now_ms
            and not self.live(now_ms)
        )

    def sticky(self, now_ms: int) -> bool:
        """Its runner keeps it: the next input wakes that runner."""
        return self.state is LeaseState.STICKY and self.expires_at_ms > now_ms

    def lease(self, reclaimed: bool = False) -> Lease:
        return Lease(
            session_id=self.session_id,
            tenant_id=self.tenant_id,
            runtime_id=self.runtime_id,
            attempt_id=self.attempt_id,
            epoch=self.epoch,
            expires_at_ms=self.expires_at_ms,
            reclaimed=reclaimed,
            failures=self.failures,
            rate_limits=self.rate_limits,
        )

    def info(self, now_ms: int) -> LeaseInfo:
        return LeaseInfo(
            lease=self.lease() if self.live(now_ms) else None,
            queued=self.queued,
            parked=self.parked,
            failures=self.failures,
            rate_limits=self.rate_limits,
            not_before_ms=self.not_before_ms,
            last_error=self.last_error,
        )


class Event(StrEnum):
    """What a transition means for metrics."""

    NONE = ""
    CLAIM = "claim"
    RENEW = "renew"
    RELEASE = "release"
    FINISH_DONE = "finish_done"
    FINISH_FAILED = "finish_failed"
    FINISH_PARKED = "finish_parked"
    EXPIRE_TTL = "expire_ttl"
    EXPIRE_DISCONNECT = "expire_disconnect"
    ENQUEUE = "enqueue"
    WAKE = "wake"
    # A Finish that asked for a window found a newer input: held on.
    CONTINUE = "continue"


@dataclass(frozen=True)
class Transition:
    before: SessionRecord
    record: SessionRecord
    # +1 a slot taken, -1 a slot returned, 0 unchanged.
    slot_delta: int = 0
    event: Event = Event.NONE
    reclaimed: bool = False
    # How long the ended lease was held (release/finish/expiry), or how long
    # the session waited in the queue (claim).
    duration_ms: int = 0

    @property
    def changed(self) -> bool:
        return self.record != self.before
