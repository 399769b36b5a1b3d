"""Provider faults end to end: a real runner process, the kernel and ledger
on real gRPC, and a model provider on real HTTP (the OpenAI wire) that
fails as each test says.

- A failure that retrying cannot fix (401, 400) parks the session after
  exactly one attempt, and both the ledger and the kernel say why.
- A rate limit (429, 529) with a `retry-after` delays the next attempt by at
  least that wait, and does not spend the attempts meant for real failures:
  more rate limits than KEEL_MAX_ATTEMPTS still end in an answer.
- A provider that never stops rate limiting ends in a parked session, after
  the rate-limit ceiling (KEEL_MAX_RATE_LIMITED), with a reason saying so.

Waits are asserted on the ledger's timestamps (a failure's, then the next
epoch's), never on the test's clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.config import Settings
from services.common.secrets import SecretPolicy
from services.ledger import CommittedFact
from tests.support.cluster import Cluster, running_cluster
from tests.support.fault_provider import ANSWER, FaultyProvider, openai_error
from tests.support.ledger_invariants import assert_recovered
from tests.support.polling import eventually
from tests.support.ports import free_port
from tests.support.processes import ChildProcess

MAX_ATTEMPTS = 3
MAX_RATE_LIMITED = 5
# Short enough that only a provider's retry-after makes an attempt wait 1 s.
BACKOFF_BASE_MS = 50
DEADLINE_S = 30.0


@pytest.fixture
def provider_port() -> int:
    return free_port()


@pytest.fixture
def policy(provider_port: int) -> SecretPolicy:
    return SecretPolicy().with_origin(f"http://127.0.0.1:{provider_port}")


@pytest.fixture
async def provider(provider_port: int) -> AsyncIterator[FaultyProvider]:
    async with FaultyProvider(port=provider_port) as serving:
        yield serving


@pytest.fixture
async def cluster(
    pg_settings: Settings, policy: SecretPolicy, provider: FaultyProvider
) -> AsyncIterator[Cluster]:
    async with running_cluster(
        pg_settings.with_overrides(secrets=policy),
        max_attempts=MAX_ATTEMPTS,
        max_rate_limited=MAX_RATE_LIMITED,
        backoff_base_ms=BACKOFF_BASE_MS,
    ) as running:
        model = {"provider": "openai", "name": "gpt-test", "baseUrl": f"{provider.url}/v1"}
        await running.kernel.put_loadout("default", {"model": model})
        yield running


async def start_runner(cluster: Cluster, policy: SecretPolicy) -> ChildProcess:
    runner = cluster.start_runner(**policy.to_env())
    await cluster.runner_ready(runner)
    return runner


def of_kind(facts: list[CommittedFact], kind: str) -> list[CommittedFact]:
    return [fact for fact in facts if fact.kind == kind]


async def parked_facts(cluster: Cluster, session_id: str, after: int = 0) -> list[CommittedFact]:
    """The session's facts once a `session_parked` newer than `after` is in."""

    async def probe() -> list[CommittedFact] | None:
        facts = await cluster.facts(session_id)
        return facts if any(f.seq > after for f in of_kind(facts, "session_parked")) else None

    return await eventually(probe, f"{session_id} to be parked", DEADLINE_S)


def waits(facts: list[CommittedFact]) -> list[tuple[int, int]]:
    """(the wait the provider asked for, how long until the next epoch
    started) for each failed attempt that was retried."""
    out = []
    for failure in of_kind(facts, "attempt_failed"):
        retry = next((f for f in facts if f.seq > failure.seq and f.kind == "epoch_started"), None)
        if retry is not None:
            out.append((failure.data["retryAfterMs"], retry.timestamp_ms - failure.timestamp_ms))
    return out


async def test_a_failure_retrying_cannot_fix_parks_after_one_attempt(
    cluster: Cluster, policy: SecretPolicy, provider: FaultyProvider
) -> None:
    # Refused every time: only the runner's judgement stops the retries.
    provider.then = openai_error(401, "Incorrect API key provided.", "invalid_api_key")
    await start_runner(cluster, policy)
    await cluster.new_session("refused")
    seq = await cluster.send("refused", "hello", "r1")

    facts = await parked_facts(cluster, "refused")
    [failure] = of_kind(facts, "attempt_failed")
    assert failure.data["retryable"] is False and "Incorrect API key" in failure.data["error"]
    [parked] = of_kind(facts, "session_parked")
    reason = parked.data["reason"]
    assert reason.startswith("failed with an error that retrying cannot fix: ")
    assert "Incorrect API key" in reason
    assert [f.kind for f in facts[-3:]] == ["epoch_started", "attempt_failed", "session_parked"]
    assert provider.requests == 1, "asked once, never again"
    info = await cluster.kernel.get_lease("refused")
    assert info.parked and info.failures == 1 and info.last_error == reason
    view = await cluster.ledger.get_session("refused")
    assert view.parked and view.owed_input_seqs == (seq,)

    # A new input unparks it; a 400 parks it again after one attempt.
    provider.then = openai_error(400, "Invalid value for 'messages'.", "invalid_value")
    again = await cluster.send("refused", "again", "r2")
    await cluster.kernel.enqueue("refused", "default", input_seq=again, unpark=True)
    facts = await parked_facts(cluster, "refused", after=parked.seq)
    assert len(of_kind(facts, "attempt_failed")) == 2
    assert "Invalid value" in of_kind(facts, "session_parked")[-1].data["reason"]
    assert provider.requests == 2


@pytest.mark.slow
async def test_rate_limits_wait_for_retry_after_and_spare_the_attempts(
    cluster: Cluster, policy: SecretPolicy, provider: FaultyProvider
) -> None:
    # More rate limits than MAX_ATTEMPTS, each asking for a second, in the
    # header forms providers use; then the answer.
    provider.queue(
        openai_error(429, "Rate limit reached.", "rate_limit_exceeded", retry_after="1"),
        openai_error(529, "Overloaded.", retry_after_ms="1200"),
        openai_error(429, "Rate limit reached.", retry_after="1", retry_after_ms="1000"),
        openai_error(429, "Rate limit reached.", retry_after="1"),
    )
    assert len(provider.faults) > MAX_ATTEMPTS
    await start_runner(cluster, policy)
    await cluster.new_session("throttled")
    seq = await cluster.send("throttled", "hello", "r1")
    await cluster.settled("throttled", DEADLINE_S)

    facts = await cluster.facts("throttled")
    assert_recovered(facts)
    failures = of_kind(facts, "attempt_failed")
    assert [f.data["attempt"] for f in failures] == [1, 2, 3, 4]
    assert all(f.data["rateLimited"] and f.data["retryable"] for f in failures)
    assert of_kind(facts, "session_parked") == []
    answer = facts[-1]
    assert answer.kind == "assistant" and answer.data["inputSeqs"] == [seq]
    assert answer.data["content"][0]["text"] == ANSWER
    # Each retry started no earlier than the provider asked.
    asked = waits(facts)
    assert [wanted for wanted, _ in asked] == [1000, 1200, 1000, 1000]
    assert all(waited >= wanted for wanted, waited in asked), asked
    info = await cluster.kernel.get_lease("throttled")
    assert (info.parked, info.failures, info.rate_limits) == (False, 0, 0)
    assert provider.requests == 5


@pytest.mark.slow
async def test_a_provider_that_always_rate_limits_parks_at_the_ceiling(
    cluster: Cluster, policy: SecretPolicy, provider: FaultyProvider
) -> None:
    provider.then = openai_error(429, "Rate limit reached.", retry_after="1")
    await start_runner(cluster, policy)
    await cluster.new_session("starved")
    await cluster.send("starved", "hello", "r1")

    facts = await parked_facts(cluster, "starved")
    failures = of_kind(facts, "attempt_failed")
    assert len(failures) == MAX_RATE_LIMITED > MAX_ATTEMPTS
    assert all(f.data["rateLimited"] for f in failures)
    assert all(waited >= wanted for wanted, waited in waits(facts))
    [parked] = of_kind(facts, "session_parked")
    reason = parked.data["reason"]
    assert reason.startswith(
        f"still rate limited by the model provider after {MAX_RATE_LIMITED} attempts "
        f"(the limit is {MAX_RATE_LIMITED}): "
    )
    info = await cluster.kernel.get_lease("starved")
    assert info.parked and info.last_error == reason
    assert (info.failures, info.rate_limits) == (0, MAX_RATE_LIMITED)
    assert provider.requests == MAX_RATE_LIMITED
