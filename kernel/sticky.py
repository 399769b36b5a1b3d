"""Where a sticky session's wake goes: the LeaseStream of the runner keeping it.

A runner asks for a sticky window on a Finish sent over its LeaseStream, or
on the append of its final answer, which the ledger settles for the kernel
(kernel/turn_settlement.py). The runner's LeaseStream is the way to reach
it (bound by its claims and its Finishes on that stream): an Enqueue for a
session in its window holds the lease again for that runner (same epoch)
and sends the lease down that stream as an unasked `wake`, instead of
queueing a claim.

Only streams of this kernel process are known here. An input that reaches
another kernel replica, or arrives after the stream ended, finds no route:
the window ends and the session is claimed like any other (epoch + 1). A
wake whose stream ended between the decision and the send is released at
once, so the session does not wait for the lease's TTL.
"""

from __future__ import annotations

import logging
from typing import Protocol

from keel.kernel.v1 import kernel_pb2 as pb

log = logging.getLogger(__name__)

# The longest window a runner may ask for: past it an idle runner's memory
# of the session is more likely stale than useful.
MAX_STICKY_MS = 600_000


class WakeTarget(Protocol):
    """One LeaseStream, as the routes see it."""

    def known(self, tenant_id: str, revision: int) -> bool:
        """This stream already sent that loadout document."""
        ...

    def send_wake(self, wake: pb.ClaimResponse) -> bool:
        """Queues the wake on the stream; False once the stream is over."""
        ...


class WakeRoutes:
    """The LeaseStream of each runtime that keeps sticky sessions here."""

    def __init__(self) -> None:
        self._routes: dict[str, WakeTarget] = {}

    def bind(self, runtime_id: str, stream: WakeTarget) -> None:
        # The newest stream of a runtime wins: a runner that reconnected
        # reads only its new stream.
        self._routes[runtime_id] = stream

    def unbind(self, stream: WakeTarget) -> None:
        for runtime_id, bound in list(self._routes.items()):
            if bound is stream:
                del self._routes[runtime_id]

    def reachable(self, runtime_id: str) -> bool:
        # Read from the enqueue's database thread: a dict lookup, no await.
        return runtime_id in self._routes

    def get(self, runtime_id: str) -> WakeTarget | None:
        return self._routes.get(runtime_id)


def granted_ms(asked_ms: int) -> int:
    """The window a Finish asking for `asked_ms` gets."""
    return max(0, min(asked_ms, MAX_STICKY_MS))
