"""What an input asks of work already under way: the double-texting
strategy (`multitask`) of POST …/inputs and SendInput.

- `enqueue` (the default): committed and answered next, after the answer
  under way (or together with the inputs it has not read yet);
- `reject`: refused with 409 `session_busy` (FAILED_PRECONDITION
  SESSION_BUSY) while the session owes anything, nothing committed: the
  ledger decides it with the append, so no input slips in between;
- `interrupt`: committed marked `multitask: interrupt`; the running attempt
  stops at its next step (what it committed stays) and the next attempt
  answers the earlier inputs and this one together;
- `rollback`: a cancel and the input are committed in one append; the
  cancel withdraws every input owed before it (kept in the ledger, settled
  as cancelled, out of the model's context) and only this input is answered.

Each is correct under crashes because each is facts in the ledger, decided
at once: a successor sees the interrupt as an owed input, and the
rollback's cancel as any cancel.

A request that names no strategy takes its tenant's (the loadout's
`multitask`, default `enqueue`), read from the kernel at most once per
`DEFAULT_TTL_S` per tenant: a loadout change reaches inputs within that.
While the kernel cannot be asked, the last value read stands (`enqueue` if
none was): an input is still committed then, and woken once the kernel is
back, as any input committed during a kernel outage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from services.common.errors import KeelError
from services.ledger.facts import MULTITASK_MODES, Multitask

log = logging.getLogger(__name__)

ENQUEUE: Final = "enqueue"
REJECT: Final = "reject"
ROLLBACK: Final = "rollback"
DEFAULT_TTL_S = 2.0

# tenant -> its loadout document (what the kernel's GetLoadout answers).
ReadLoadout = Callable[[str], Awaitable[dict[str, object]]]


def mode_of(document: dict[str, object]) -> Multitask:
    """A loadout's default strategy (the kernel validated the document)."""
    named = document.get("multitask")
    return named if named in MULTITASK_MODES else ENQUEUE


class TenantDefaults:
    """Each tenant's default strategy, kept for a short while."""

    def __init__(self, read: ReadLoadout, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._read = read
        self._ttl_s = ttl_s
        self._known: dict[str, tuple[float, Multitask]] = {}

    async def of(self, tenant_id: str) -> Multitask:
        now = time.monotonic()
        known = self._known.get(tenant_id)
        if known is not None and known[0] > now:
            return known[1]
        try:
            mode = mode_of(await self._read(tenant_id))
        except KeelError as away:
            log.debug("tenant %s's multitask default unread: %s", tenant_id, away)
            return known[1] if known is not None else ENQUEUE
        self._known[tenant_id] = (now + self._ttl_s, mode)
        return mode
