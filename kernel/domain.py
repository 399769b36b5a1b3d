"""The kernel's rules, as pure functions: no I/O, no clock of their own.

A session's kernel state is one `SessionRecord`. Every operation is a
function from a record and the time to a `Transition` (the new record, the
change in its tenant's admission slots, and what to count), or it raises a
`KernelError`. The store loads a record under a row lock, applies one of
these, and writes the result in the same transaction, so the rules here are
the whole truth about leases and the store only moves rows. The values
themselves (the record, its states, leases, transitions) are
kernel/lease_values.py, re-exported here.

Lease states::

    free ──claim──▶ held ──release──▶ released ──claim──▶ held …
                     │  ──finish───▶ finished (──enqueue, claim──▶ held)
                     │  ──finish (sticky)──▶ sticky ──enqueue (wake)──▶ held, same epoch
                     │                         └──window over, drain, no wake──▶ released
                     └──ttl / disconnect──▶ expired ──claim (reclaimed)──▶ held

A held lease occupies one admission slot of its tenant; every way out of
`held` returns it. Epochs only grow: each claim issues `epoch + 1`, and the
epoch is kept across release, finish and expiry.

Sticky: a runner that finished a turn keeps the session for a window. Its
next input wakes that runner with the same epoch (no claim, no new fence):
the epoch is still the newest, so the ledger's fence stands as it was. An
idle sticky session holds no slot (a wake takes one) and is not live: any
other way in (a claim once the window is over or the wake could not be
sent) issues `epoch + 1` as always, which fences the old holder off.
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from typing import Any

from kernel.errors import EpochSuperseded, InvalidArgument, LeaseLost

# Re-exported: the lease values (kernel.lease_values) are named here, as they always were.
from kernel.lease_values import DrainMode as DrainMode
from kernel.lease_values import Event as Event
from kernel.lease_values import ExpiredBy as ExpiredBy
from kernel.lease_values import FinishResult as FinishResult
from kernel.lease_values import Lease as Lease
from kernel.lease_values import LeaseInfo as LeaseInfo
from kernel.lease_values import LeaseState as LeaseState
from kernel.lease_values import SessionRecord as SessionRecord
from kernel.lease_values import Transition as Transition

# Re-exported: callers of `finish` name the failure kind and the policy here.
from kernel.retries import FailureKind as FailureKind
from kernel.retries import RetryPolicy as RetryPolicy
from kernel.retries import settle_failure

DEFAULT_MAX_RUNS = 8
DEFAULT_LOADOUT: dict[str, Any] = {
    "model": {"provider": "scripted", "name": "scripted-1"},
    "systemPrompt": "You are a helpful assistant.",
    "tools": ["clock", "sleep", "counter"],
    "compaction": {"enabled": True},
    "maxConcurrentRuns": DEFAULT_MAX_RUNS,
}

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}")


def check_id(value: str, what: str) -> str:
    """Ids (sessions, tenants, runtimes) share the ledger's alphabet."""
    if not _ID.fullmatch(value):
        raise InvalidArgument(
            f"{what} must be 1-128 characters of letters, digits, '_.:-', got {value[:140]!r}",
            field=what,
        )
    return value


def unchanged(record: SessionRecord) -> Transition:
    return Transition(record, record)


def enqueue(record: SessionRecord, input_seq: int, unpark: bool, now_ms: int) -> Transition:
    """Marks the session as owing work; `unpark` also clears a parked state."""
    updated = replace(record, input_seq=max(record.input_seq, input_seq))
    if unpark and record.parked:
        updated = replace(
            updated, parked=False, failures=0, rate_limits=0, not_before_ms=0, queued_at_ms=now_ms
        )
    if not record.queued:
        updated = replace(updated, queued=True, queued_at_ms=now_ms)
    return Transition(record, updated, event=Event.ENQUEUE)


def claim(
    record: SessionRecord, runtime_id: str, attempt_id: str, now_ms: int, ttl_ms: int
) -> Transition:
    """Issues the next epoch to `runtime_id`; the caller checked `claimable`."""
    if not record.claimable(now_ms):
        raise LeaseLost(f"session {record.session_id!r} is not claimable", state=record.state)
    # A lease still marked held here is past its TTL: it expired, and its slot
    # passes straight to the new lease.
    was_held = record.state is LeaseState.HELD
    reclaimed = was_held or record.state is LeaseState.EXPIRED
    updated = replace(
        record,
        state=LeaseState.HELD,
        runtime_id=runtime_id,
        attempt_id=attempt_id,
        epoch=record.epoch + 1,
        expires_at_ms=now_ms + ttl_ms,
        claimed_at_ms=now_ms,
        expired_by=ExpiredBy.TTL if was_held else record.expired_by,
    )
    waited = max(0, now_ms - max(record.queued_at_ms, record.not_before_ms))
    return Transition(
        record,
        updated,
        slot_delta=0 if was_held else 1,
        event=Event.CLAIM,
        reclaimed=reclaimed,
        duration_ms=waited,
    )


def expire_due(record: SessionRecord, now_ms: int) -> Transition:
    """A held lease past its TTL becomes expired (its slot returns)."""
    if record.state is not LeaseState.HELD or record.expires_at_ms > now_ms:
        return unchanged(record)
    updated = replace(record, state=LeaseState.EXPIRED, expired_by=ExpiredBy.TTL)
    return Transition(
        record,
        updated,
        slot_delta=-1,
        event=Event.EXPIRE_TTL,
        duration_ms=max(0, now_ms - record.claimed_at_ms),
    )


def expire_for_disconnect(record: SessionRecord, now_ms: int) -> Transition:
    """The owner's connection died: the lease ends now, not at its TTL."""
    if not record.live(now_ms):
        return expire_due(record, now_ms)
    updated = replace(
        record, state=LeaseState.EXPIRED, expired_by=ExpiredBy.DISCONNECT, expires_at_ms=now_ms
    )
    return Transition(
        record,
        updated,
        slot_delta=-1,
        event=Event.EXPIRE_DISCONNECT,
        duration_ms=max(0, now_ms - record.claimed_at_ms),
    )


def check_holder(record: SessionRecord, epoch: int, runtime_id: str, now_ms: int) -> None:
    """Raises unless `runtime_id` holds the live lease of `epoch`."""
    if record.epoch == 0:
        raise LeaseLost(f"session {record.session_id!r} was never leased", state=record.state)
    if epoch != record.epoch:
        raise EpochSuperseded(
            f"epoch {epoch} of session {record.session_id!r} is stale "
            f"(current epoch {record.epoch})",
            current_epoch=str(record.epoch),
        )
    if runtime_id != record.runtime_id:
        raise LeaseLost(
            f"epoch {epoch} of session {record.session_id!r} belongs to another runtime",
            state=record.state,
        )
    if not record.live(now_ms):
        raise LeaseLost(
            f"the lease of session {record.session_id!r} epoch {epoch} is {record.state}",
            state=record.state,
            expired_by=record.expired_by,
        )


def renew(
    record: SessionRecord, epoch: int, runtime_id: str, now_ms: int, ttl_ms: int
) -> Transition:
    check_holder(record, epoch, runtime_id, now_ms)
    updated = replace(record, expires_at_ms=max(record.expires_at_ms, now_ms + ttl_ms))
    return Transition(record, updated, event=Event.RENEW)


def wake(record: SessionRecord, now_ms: int, ttl_ms: int) -> Transition:
    """A sticky session's input arrived: its holder holds the lease again,
    same epoch and attempt, with a slot (the caller took it)."""
    if not record.sticky(now_ms) or record.parked:
        raise LeaseLost(f"session {record.session_id!r} is not sticky", state=record.state)
    updated = replace(
        record,
        state=LeaseState.HELD,
        expires_at_ms=now_ms + ttl_ms,
        claimed_at_ms=now_ms,
        expired_by="",
    )
    waited = max(0, now_ms - record.queued_at_ms)
    return Transition(record, updated, slot_delta=1, event=Event.WAKE, duration_ms=waited)


def end_sticky(record: SessionRecord, now_ms: int) -> Transition:
    """The sticky window ends (over, drained, or its input could not wake
    the holder): the session is free like a released one."""
    if record.state is not LeaseState.STICKY:
        return unchanged(record)
    updated = replace(
        record, state=LeaseState.RELEASED, expires_at_ms=min(record.expires_at_ms, now_ms)
    )
    return Transition(record, updated)


def release(record: SessionRecord, epoch: int, runtime_id: str, now_ms: int) -> Transition:
    """Hands the lease back: slot returned, session claimable at once if owed."""
    if (
        record.state is LeaseState.STICKY
        and record.epoch == epoch
        and record.runtime_id == runtime_id
    ):
        # The holder lets a sticky session go before its window is over.
        return end_sticky(record, now_ms)
    already = (
        record.state is LeaseState.RELEASED
        and record.epoch == epoch
        and record.runtime_id == runtime_id
    )
    if already:
        # A retried Release (the reply was lost) is not an error.
        return unchanged(record)
    check_holder(record, epoch, runtime_id, now_ms)
    updated = replace(record, state=LeaseState.RELEASED, expires_at_ms=now_ms, expired_by="")
    return Transition(
        record,
        updated,
        slot_delta=-1,
        event=Event.RELEASE,
        duration_ms=max(0, now_ms - record.claimed_at_ms),
    )


def finish(
    record: SessionRecord,
    epoch: int,
    runtime_id: str,
    read_through: int,
    failed: bool,
    error: str,
    now_ms: int,
    policy: RetryPolicy,
    *,
    kind: FailureKind = FailureKind.RETRYABLE,
    retry_after_ms: int = 0,
    sticky_ms: int = 0,
    ttl_ms: int = 0,
    may_continue: bool = True,
) -> tuple[Transition, FinishResult]:
    """Settles an attempt.

    Success clears the failure counts; the session leaves the queue unless an
    input newer than `read_through` was announced. With `sticky_ms` and
    nothing newer, the holder keeps the session for that long (`sticky`): its
    slot returns, its epoch stays, and the next input wakes it; with a newer
    input there already, the lease is held on for `ttl_ms` (`continued`) and
    the holder answers that input at once, as if woken, unless other
    sessions of the tenant wait in the queue (`may_continue` False): then it
    is re-queued behind them. A failure of `kind` is
    retried or parks the session by the rules of `kernel.retries` (a
    provider's `retry_after_ms` delays the next attempt); parked, the
    record's `last_error` says why.
    """
    check_holder(record, epoch, runtime_id, now_ms)
    ended = replace(record, state=LeaseState.FINISHED, expires_at_ms=now_ms, expired_by="")
    held_for = max(0, now_ms - record.claimed_at_ms)
    can_hold_on = may_continue and sticky_ms > 0 and ttl_ms > 0
    if not failed and can_hold_on and record.input_seq > read_through:
        held_on = replace(
            record,
            expires_at_ms=now_ms + ttl_ms,
            claimed_at_ms=now_ms,
            failures=0,
            rate_limits=0,
            last_error="",
            not_before_ms=0,
        )
        transition = Transition(record, held_on, event=Event.CONTINUE, duration_ms=held_for)
        return transition, FinishResult(
            requeued=False, parked=False, not_before_ms=0, continued=True
        )
    if not failed:
        newer = record.input_seq > read_through
        updated = replace(
            ended,
            failures=0,
            rate_limits=0,
            last_error="",
            not_before_ms=0,
            queued=newer,
            queued_at_ms=now_ms if newer else record.queued_at_ms,
        )
        result = FinishResult(requeued=newer, parked=False, not_before_ms=0)
        if sticky_ms > 0 and not newer:
            updated = replace(updated, state=LeaseState.STICKY, expires_at_ms=now_ms + sticky_ms)
            result = replace(result, sticky_until_ms=now_ms + sticky_ms)
        event = Event.FINISH_DONE
    else:
        outcome = settle_failure(
            record.failures, record.rate_limits, kind, error, retry_after_ms, now_ms, policy
        )
        updated = replace(
            ended,
            failures=outcome.failures,
            rate_limits=outcome.rate_limits,
            last_error=outcome.parked_reason or error,
            queued=True,
            parked=outcome.parked,
            not_before_ms=outcome.not_before_ms,
            queued_at_ms=now_ms,
        )
        result = FinishResult(
            requeued=not outcome.parked,
            parked=outcome.parked,
            not_before_ms=outcome.not_before_ms,
            parked_reason=outcome.parked_reason,
        )
        event = Event.FINISH_PARKED if outcome.parked else Event.FINISH_FAILED
    transition = Transition(record, updated, slot_delta=-1, event=event, duration_ms=held_for)
    return transition, result


# -- admission --


def max_runs_of(document: dict[str, Any]) -> int:
    # `admission.maxConcurrentRuns` (SPEC §10) wins over the older top level.
    admission = document.get("admission")
    nested = admission.get("maxConcurrentRuns") if isinstance(admission, dict) else None
    value = nested if nested is not None else document.get("maxConcurrentRuns")
    if value is None:
        value = DEFAULT_MAX_RUNS
    # bool is an int subclass; `true` is not a count.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(
            f"maxConcurrentRuns must be a positive integer, got {value!r}",
            field="maxConcurrentRuns",
        )
    return value


def default_loadout() -> dict[str, Any]:
    """A fresh copy, so a caller editing it cannot change the default."""
    return copy.deepcopy(DEFAULT_LOADOUT)
