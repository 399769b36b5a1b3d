"""How a failed attempt is retried, or why the session is parked instead.

Pure rules (no I/O, no clock): `kernel.domain.finish` applies them to a
session's record. A runner says what kind of failure ended its attempt:

- `RETRYABLE`: a fault that may pass (a 5xx, a broken stream, a bug).
  Retried with exponential backoff; `max_attempts` consecutive ones park.
- `PERMANENT`: retrying cannot help (the provider refused the request or
  the key, the context overflows with nothing left to compact). Parked at
  once: the same request would fail the same way, and each try may cost.
- `RATE_LIMITED`: the provider is throttling (429, 529 overloaded). Not a
  fault of the session, so it does not spend `max_attempts`; it has its own
  ceiling, `max_rate_limited` consecutive ones, so a provider that never
  stops refusing still ends in a parked session that says so.

A provider's `retry-after` (any kind but permanent) sets the earliest next
attempt: the backoff and the provider's wait, whichever is longer, with the
provider's capped at `retry_after_cap_ms` so a wild header cannot hide a
session for days. A success, or an unpark, clears both counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    RETRYABLE = "retryable"
    PERMANENT = "permanent"
    RATE_LIMITED = "rate_limited"


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 5
    backoff_base_ms: int = 1_000
    backoff_cap_ms: int = 60_000
    # Consecutive rate-limited attempts after which a session is parked.
    max_rate_limited: int = 20
    # The longest wait a provider's retry-after is honoured for.
    retry_after_cap_ms: int = 900_000

    def backoff_ms(self, failures: int) -> int:
        """Delay after the `failures`-th consecutive failure (base, 2 base, 4 base …)."""
        if failures <= 0:
            return 0
        # The shift is bounded so a huge failure count cannot build a huge int.
        return min(self.backoff_cap_ms, self.backoff_base_ms << min(failures - 1, 32))


@dataclass(frozen=True)
class FailureOutcome:
    """What one failed attempt leaves behind."""

    # Consecutive failures (toward max_attempts) and rate limits (toward
    # max_rate_limited), this one included.
    failures: int
    rate_limits: int
    # Why the session is parked; "" when it will be retried.
    parked_reason: str
    # Not claimable before this time (0 when parked).
    not_before_ms: int

    @property
    def parked(self) -> bool:
        return bool(self.parked_reason)


def settle_failure(
    failures: int,
    rate_limits: int,
    kind: FailureKind,
    error: str,
    retry_after_ms: int,
    now_ms: int,
    policy: RetryPolicy,
) -> FailureOutcome:
    """The counts, park decision and next earliest attempt after a failure,
    given the consecutive counts before it."""
    reason = ""
    if kind is FailureKind.RATE_LIMITED:
        rate_limits += 1
        delay = policy.backoff_ms(rate_limits)
        if rate_limits >= policy.max_rate_limited:
            reason = (
                f"still rate limited by the model provider after {rate_limits} attempts "
                f"(the limit is {policy.max_rate_limited}): {error}"
            )
    else:
        failures += 1
        delay = policy.backoff_ms(failures)
        if kind is FailureKind.PERMANENT:
            reason = f"failed with an error that retrying cannot fix: {error}"
        elif failures >= policy.max_attempts:
            reason = f"gave up after {failures} failed attempts: {error}"
    if reason:
        return FailureOutcome(failures, rate_limits, reason, 0)
    waited = max(delay, min(max(retry_after_ms, 0), policy.retry_after_cap_ms))
    return FailureOutcome(failures, rate_limits, "", now_ms + waited)
