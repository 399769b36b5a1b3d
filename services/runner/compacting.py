"""`ServiceCompaction`: the runner's compaction hook, backed by the service.

Before each model request the attempt asks `before_request`. The decision is
made here, locally and cheaply, with the same pure policy the service uses;
only when a compaction is due is the service called (its Compact summarizes
and commits under the attempt's epoch, so a fenced attempt cannot compact).

The loop guards live in the LEDGER, not in process memory, so a crash or a
handoff never resets them:

- stale usage: a usage figure older than the latest compaction never
  triggers another one (the policy's estimate ignores it);
- failures: every failed compaction (the summary failed, or would not have
  shrunk the context) commits `compaction_failed{error, consecutive,
  suspended, loadoutRevision}`. The failures since the latest compaction,
  under the current loadout revision, are the consecutive ones; after
  `MAX_CONSECUTIVE_COMPACTION_FAILURES` the session stops compacting (the
  last fact says `suspended`) until something changes: a compaction succeeds
  (a manual Compact) or the tenant stores a new loadout. An unreachable
  service is not a failed compaction;
- overflow: a provider overflow gets one compact-and-retry. If no compaction
  could be committed the attempt fails at once with the reason (retrying the
  same request would overflow again); a second overflow after a successful
  compaction is failed by the Attempt itself.

Outside an overflow retry a failed compaction never fails the attempt: the
request goes ahead with the uncompacted context.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from agent_io.providers import ProviderError
from compaction.client import CompactionClient, CompactResult
from compaction.errors import CompactionFenced
from compaction.policy import (
    compaction_suspended,
    plan_compaction,
    resolve_context_window,
    settings_from_dict,
)
from services.common import tracing
from services.common.config import Settings
from services.common.errors import KeelError, ServiceUnavailable
from services.ledger.facts import COMPACTION, COMPACTION_FAILED, CommittedFact
from services.runner.attempt import Attempt, Fenced
from services.runner.events import COMPACTING, RUNNING

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_WINDOW = 128_000


def consecutive_failures(facts: Sequence[CommittedFact], loadout_revision: int) -> int:
    """Failed compactions in a row: since the latest successful one, and under
    the same loadout revision (a new revision may well fix the settings or
    the model, so it is a change worth trying again for)."""
    count = 0
    for fact in reversed(facts):
        if fact.kind == COMPACTION:
            break
        if fact.kind == COMPACTION_FAILED:
            if fact.data.get("loadoutRevision") != loadout_revision:
                break
            count += 1
    return count


class ServiceCompaction:
    """A `CompactionHook` calling the compaction service at `target`."""

    def __init__(
        self,
        target: str,
        settings: Settings | None = None,
        *,
        default_context_window: int = DEFAULT_CONTEXT_WINDOW,
    ) -> None:
        self.client = CompactionClient(target, settings)
        self.default_context_window = default_context_window

    async def close(self) -> None:
        await self.client.close()

    async def before_request(
        self, attempt: Attempt, facts: Sequence[CommittedFact], *, overflowed: bool
    ) -> bool:
        """Compacts when due (or after an overflow); True when a compaction
        fact was committed and the attempt's facts now include it."""
        try:
            settings = settings_from_dict(attempt.loadout.compaction)
        except ValueError as error:
            # A tenant's bad settings must not take its sessions down.
            log.warning("session %s: compaction settings ignored: %s", attempt.session_id, error)
            return self._not_compacted(overflowed, f"invalid compaction settings: {error}")
        if not settings.enabled:
            return self._not_compacted(overflowed, "compaction is disabled for this tenant")
        entries = attempt.context()
        window = resolve_context_window(
            attempt.provider.context_window, self.default_context_window
        )
        plan = plan_compaction(entries, settings, window)
        if not (overflowed or plan.should_compact):
            return False
        if plan.preparation is None:
            return self._not_compacted(overflowed, "there is nothing left to compact")
        failures = consecutive_failures(facts, attempt.loadout.revision)
        if compaction_suspended(failures):
            return self._not_compacted(
                overflowed, f"compaction is suspended after {failures} failures in a row"
            )

        reason = "overflow" if overflowed else "threshold"
        log.info(
            "session %s: compacting (%s): %d tokens, limit %d",
            attempt.session_id,
            reason,
            plan.context_tokens,
            plan.limit,
        )
        attempt.status(COMPACTING)
        try:
            with tracing.span(
                "keel.compaction", attempt.trace_attributes, {"keel.compaction.reason": reason}
            ):
                result, failure = await self._compact(attempt, reason)
        finally:
            attempt.status(RUNNING)

        if result is not None:
            if result.compacted:
                await attempt.refresh()
                return True
            if not result.not_reduced:
                # Skipped before any summary was written (nothing to compact,
                # an unread input in the way): not a failure, nothing was spent.
                return self._not_compacted(overflowed, result.skipped_reason)
            failure = result.skipped_reason
        if failure is None:
            # The service could not be reached: nothing was tried, so this is
            # not a failed compaction (an outage must not suspend sessions).
            return self._not_compacted(overflowed, "the compaction service is unavailable")
        await self._record_failure(attempt, failures + 1, reason, failure)
        return self._not_compacted(overflowed, f"compaction failed: {failure}")

    async def _compact(
        self, attempt: Attempt, reason: str
    ) -> tuple[CompactResult | None, str | None]:
        """The service's answer, or None and the error that stopped it (None
        too when the service was unreachable)."""
        try:
            watermark = attempt.watermark if attempt.resumed else 0
            compacted = await self.client.compact(
                attempt.session_id, attempt.epoch, reason, watermark=watermark
            )
            return compacted, None
        except CompactionFenced as stale:
            raise Fenced(str(stale)) from None
        except ServiceUnavailable as unreachable:
            log.warning("session %s: %s", attempt.session_id, unreachable.message)
            return None, None
        except KeelError as failure:
            return None, failure.message

    async def _record_failure(
        self, attempt: Attempt, consecutive: int, reason: str, error: str
    ) -> None:
        suspended = compaction_suspended(consecutive)
        log.warning(
            "session %s: compaction failed (%d in a row%s): %s",
            attempt.session_id,
            consecutive,
            ", suspended" if suspended else "",
            error,
        )
        # Committed under the attempt's epoch (a fenced attempt raises Fenced):
        # the count must survive crashes, so it lives in the ledger.
        await attempt.commit(
            COMPACTION_FAILED,
            {
                "error": error,
                "reason": reason,
                "consecutive": consecutive,
                "suspended": suspended,
                "loadoutRevision": attempt.loadout.revision,
            },
        )

    @staticmethod
    def _not_compacted(overflowed: bool, why: str) -> bool:
        if overflowed:
            # The request does not fit and nothing made it smaller: the retry
            # would overflow the same way, so the attempt fails now, saying why.
            raise ProviderError(
                f"the context overflows the model's window and could not be compacted: {why}",
                retryable=False,
            )
        return False
