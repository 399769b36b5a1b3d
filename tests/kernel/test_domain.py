"""The kernel's pure rules: lease transitions, epochs, backoff, parking."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kernel import domain
from kernel.domain import ExpiredBy, FailureKind, LeaseState, RetryPolicy, SessionRecord
from kernel.errors import EpochSuperseded, InvalidArgument, LeaseLost

TTL = 1_000
POLICY = RetryPolicy(max_attempts=3, backoff_base_ms=100, backoff_cap_ms=250)


def queued(now: int = 0, input_seq: int = 1) -> SessionRecord:
    record = SessionRecord(session_id="s1", tenant_id="t1")
    return domain.enqueue(record, input_seq, False, now).record


def claimed(record: SessionRecord, runtime: str = "r1", now: int = 0) -> SessionRecord:
    return domain.claim(record, runtime, f"a-{runtime}", now, TTL).record


def test_claim_issues_the_next_epoch_and_takes_a_slot() -> None:
    t = domain.claim(queued(), "r1", "a1", 10, TTL)
    assert t.record.epoch == 1
    assert t.record.expires_at_ms == 10 + TTL
    assert t.slot_delta == 1
    assert not t.reclaimed
    assert t.record.live(10) and not t.record.claimable(10)


def test_a_live_lease_cannot_be_claimed_again() -> None:
    with pytest.raises(LeaseLost):
        domain.claim(claimed(queued()), "r2", "a2", 5, TTL)


def test_release_returns_the_slot_and_the_next_claim_is_not_a_reclaim() -> None:
    held = claimed(queued())
    released = domain.release(held, 1, "r1", 5)
    assert released.slot_delta == -1
    assert released.record.state is LeaseState.RELEASED
    assert released.record.claimable(5), "a released session owes work: claimable at once"
    again = domain.claim(released.record, "r2", "a2", 6, TTL)
    assert again.record.epoch == 2
    assert not again.reclaimed


def test_release_twice_is_harmless() -> None:
    released = domain.release(claimed(queued()), 1, "r1", 5).record
    again = domain.release(released, 1, "r1", 6)
    assert not again.changed and again.slot_delta == 0


@pytest.mark.parametrize("by", ["ttl", "disconnect"])
def test_expiry_returns_the_slot_and_the_next_claim_is_a_reclaim(by: str) -> None:
    held = claimed(queued())
    if by == "ttl":
        ended = domain.expire_due(held, TTL)
    else:
        ended = domain.expire_for_disconnect(held, 3)
        assert ended.record.expires_at_ms == 3
    assert ended.slot_delta == -1
    assert ended.record.expired_by == by
    successor = domain.claim(ended.record, "r2", "a2", TTL + 1, TTL)
    assert successor.reclaimed
    assert successor.record.epoch == 2
    assert successor.slot_delta == 1


def test_a_lease_past_its_ttl_passes_its_slot_straight_to_the_successor() -> None:
    held = claimed(queued())
    successor = domain.claim(held, "r2", "a2", TTL, TTL)
    assert successor.reclaimed and successor.slot_delta == 0
    assert successor.record.expired_by == ExpiredBy.TTL


def test_expire_due_leaves_a_live_lease_alone() -> None:
    held = claimed(queued())
    assert not domain.expire_due(held, TTL - 1).changed


def test_renew_extends_and_checks_the_holder() -> None:
    held = claimed(queued())
    assert domain.renew(held, 1, "r1", 500, TTL).record.expires_at_ms == 500 + TTL
    with pytest.raises(EpochSuperseded) as stale:
        domain.renew(held, 2, "r1", 500, TTL)
    assert stale.value.metadata["current_epoch"] == "1"
    with pytest.raises(LeaseLost):
        domain.renew(held, 1, "r2", 500, TTL)
    with pytest.raises(LeaseLost):
        domain.renew(held, 1, "r1", TTL, TTL)
    with pytest.raises(LeaseLost, match="never leased"):
        domain.renew(queued(), 1, "r1", 0, TTL)


def test_a_predecessor_is_stale_after_a_takeover() -> None:
    expired = domain.expire_for_disconnect(claimed(queued()), 1).record
    successor = claimed(expired, "r2", 2)
    with pytest.raises(EpochSuperseded):
        domain.renew(successor, 1, "r1", 3, TTL)
    with pytest.raises(EpochSuperseded):
        domain.finish(successor, 1, "r1", 5, False, "", 3, POLICY)


def test_finish_with_a_newer_input_requeues() -> None:
    held = claimed(queued(input_seq=4))
    held = domain.enqueue(held, 7, False, 5).record
    transition, result = domain.finish(held, 1, "r1", 4, False, "", 10, POLICY)
    assert result.requeued and not result.parked
    assert transition.record.queued and transition.record.claimable(10)
    assert transition.slot_delta == -1


def test_finish_without_a_newer_input_leaves_the_queue() -> None:
    held = claimed(queued(input_seq=4))
    transition, result = domain.finish(held, 1, "r1", 4, False, "", 10, POLICY)
    assert not result.requeued
    assert not transition.record.queued
    assert not transition.record.claimable(10)


def test_failures_back_off_then_park_then_unpark() -> None:
    record = queued(input_seq=1)
    now = 0
    for failure in (1, 2):
        record = claimed(record, now=now)
        transition, result = domain.finish(record, record.epoch, "r1", 1, True, "boom", now, POLICY)
        record = transition.record
        assert result.requeued and not result.parked
        assert result.not_before_ms == now + POLICY.backoff_ms(failure)
        assert not record.claimable(result.not_before_ms - 1)
        assert record.claimable(result.not_before_ms)
        assert record.failures == failure and record.last_error == "boom"
        now = result.not_before_ms
    record = claimed(record, now=now)
    assert record.lease().failures == 2
    transition, result = domain.finish(record, record.epoch, "r1", 1, True, "boom", now, POLICY)
    assert result.parked and not result.requeued
    parked = transition.record
    assert not parked.claimable(now + 10**9)
    # A plain wake-up (e.g. reconciliation) does not unpark.
    assert not domain.enqueue(parked, 2, False, now).record.claimable(now + 10**9)
    unparked = domain.enqueue(parked, 2, True, now).record
    assert unparked.claimable(now) and unparked.failures == 0


def failed(
    record: SessionRecord,
    now: int,
    kind: FailureKind,
    retry_after_ms: int = 0,
    policy: RetryPolicy = POLICY,
) -> tuple[SessionRecord, domain.FinishResult]:
    """Claims `record` at `now` and fails the attempt with `kind`."""
    held = claimed(record, now=now)
    transition, result = domain.finish(
        held,
        held.epoch,
        "r1",
        1,
        True,
        "boom",
        now,
        policy,
        kind=kind,
        retry_after_ms=retry_after_ms,
    )
    return transition.record, result


def test_a_permanent_failure_parks_at_once_and_says_why() -> None:
    record, result = failed(queued(), 0, FailureKind.PERMANENT)
    assert result.parked and not result.requeued and result.not_before_ms == 0
    assert result.parked_reason == "failed with an error that retrying cannot fix: boom"
    assert record.parked and record.failures == 1
    info = record.info(0)
    assert info.parked and info.last_error == result.parked_reason


def test_a_retryable_failure_waits_for_the_providers_retry_after() -> None:
    record, result = failed(queued(), 50, FailureKind.RETRYABLE, retry_after_ms=5_000)
    assert result.requeued and result.not_before_ms == 50 + 5_000
    assert record.failures == 1 and record.last_error == "boom"
    # A shorter wait than the backoff does not shorten the backoff.
    _, result = failed(queued(), 50, FailureKind.RETRYABLE, retry_after_ms=1)
    assert result.not_before_ms == 50 + POLICY.backoff_ms(1)


def test_a_retry_after_is_honoured_up_to_the_cap() -> None:
    policy = replace(POLICY, retry_after_cap_ms=2_000)
    _, result = failed(queued(), 0, FailureKind.RATE_LIMITED, 10**9, policy)
    assert result.not_before_ms == 2_000


def test_rate_limits_spend_their_own_budget_not_max_attempts() -> None:
    policy = replace(POLICY, max_rate_limited=5)
    record, now = queued(), 0
    # One real failure, then more rate limits than max_attempts.
    record, result = failed(record, now, FailureKind.RETRYABLE)
    now = result.not_before_ms
    for count in range(1, policy.max_rate_limited):
        record, result = failed(record, now, FailureKind.RATE_LIMITED, 700, policy)
        assert result.requeued and not result.parked
        assert result.not_before_ms == now + max(700, policy.backoff_ms(count))
        assert (record.failures, record.rate_limits) == (1, count)
        assert claimed(record, now=result.not_before_ms).lease().rate_limits == count
        now = result.not_before_ms
    record, result = failed(record, now, FailureKind.RATE_LIMITED, 700, policy)
    assert result.parked and record.parked
    assert result.parked_reason.startswith(
        "still rate limited by the model provider after 5 attempts (the limit is 5): "
    )
    assert record.info(now).last_error == result.parked_reason
    unparked = domain.enqueue(record, 2, True, now).record
    assert (unparked.failures, unparked.rate_limits) == (0, 0)


def test_success_clears_the_rate_limit_count() -> None:
    record, result = failed(queued(), 0, FailureKind.RATE_LIMITED, 100)
    held = claimed(record, now=result.not_before_ms)
    transition, _ = domain.finish(held, held.epoch, "r1", 1, False, "", 500, POLICY)
    assert transition.record.rate_limits == 0


def test_success_resets_the_failure_count() -> None:
    record = claimed(queued())
    record = domain.finish(record, 1, "r1", 1, True, "x", 0, POLICY)[0].record
    record = claimed(record, now=POLICY.backoff_ms(1))
    transition, _ = domain.finish(record, 2, "r1", 1, False, "", 500, POLICY)
    assert transition.record.failures == 0


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RetryPolicy(backoff_base_ms=1_000, backoff_cap_ms=60_000)
    assert [policy.backoff_ms(n) for n in range(8)] == [
        0,
        1_000,
        2_000,
        4_000,
        8_000,
        16_000,
        32_000,
        60_000,
    ]
    assert policy.backoff_ms(10**6) == 60_000


def test_epochs_survive_every_ending() -> None:
    record = queued()
    epochs = []
    for step in range(6):
        record = claimed(record, now=step * 10)
        epochs.append(record.epoch)
        if step % 3 == 0:
            record = domain.release(record, record.epoch, "r1", step * 10).record
        elif step % 3 == 1:
            record = domain.expire_for_disconnect(record, step * 10).record
        else:
            record = domain.finish(record, record.epoch, "r1", 0, False, "", step * 10, POLICY)[
                0
            ].record
            record = domain.enqueue(record, 0, False, step * 10).record
    assert epochs == [1, 2, 3, 4, 5, 6]


def test_enqueue_keeps_the_newest_input_seq() -> None:
    record = domain.enqueue(queued(input_seq=9), 3, False, 0).record
    assert record.input_seq == 9


def test_a_parked_session_is_not_claimable() -> None:
    record = replace(queued(), parked=True)
    with pytest.raises(LeaseLost):
        domain.claim(record, "r1", "a", 0, TTL)


@pytest.mark.parametrize("value", ["", "a b", "x" * 129, "-lead", "tab\t", "new\nline"])
def test_bad_ids_are_refused(value: str) -> None:
    with pytest.raises(InvalidArgument):
        domain.check_id(value, "session_id")


@pytest.mark.parametrize("value", [0, -1, True, "8", 2.5])
def test_bad_admission_limits_are_refused(value: object) -> None:
    with pytest.raises(InvalidArgument):
        domain.max_runs_of({"maxConcurrentRuns": value})


def test_default_loadout_is_a_fresh_copy() -> None:
    document = domain.default_loadout()
    document["tools"].append("x")
    assert domain.default_loadout()["tools"] == ["clock", "sleep", "counter"]
    assert domain.max_runs_of(document) == 8
