"""How leases end without their holder's say: fast takeover and the TTL.

Fast takeover
-------------
A live runtime holds an Attach stream open to the kernel. When that stream
ends — the process died and its socket closed, the connection broke, or the
runtime closed it — the kernel expires every lease the runtime still holds
*at once* (`expired_by = "disconnect"`, `expires_at = now`) and wakes the
waiting claimers, instead of letting the sessions sit until the TTL runs
out. The successor's claim reports `reclaimed = true`, as after a TTL
expiry. A runtime that shuts down cleanly releases its leases first, so
there is nothing left to expire; any end of the stream is treated the same.

Why this is safe even when the runtime is not really dead (a connection
glitch, a half-open socket): the kernel is not what keeps two writers
apart — the ledger is. Every runner write to a session stream carries its
epoch, and the ledger rejects any write whose epoch is not the stream's
current fence (`STALE_EPOCH`). The successor's first write is
`epoch_started{epoch + 1}`, which raises the fence atomically with the
stream version (optimistic concurrency). From that moment on, no write of
the presumed-dead owner can be accepted. Expiring a lease too early can
therefore cost duplicate *work* — a tool re-executed at-least-once by the
successor, with the same idempotency key — but never a duplicate or
conflicting *fact*. The old owner also learns quickly: its next Renew fails
with `LEASE_LOST`/`STALE_EPOCH` and it stops.

Losing a whole node
-------------------
A runtime that dies together with the kernel holding its stream ends no
stream anywhere else; kernel.liveness covers it: that kernel stops writing
the runtime's heartbeat, and any other kernel expires its leases the same
way a few seconds later.

TTL
---
The TTL (`KEEL_LEASE_MS`) still covers what a stream cannot see: a network
partition (no FIN ever arrives), a hung or SIGSTOPped process whose socket
stays open. The sweeper expires leases past their TTL every fraction of
it, returning their admission slots and waking claimers.

A kernel that is itself shutting down ends its Attach streams on purpose;
those ends are not the runtimes' deaths and expire nothing (the runtimes
re-attach to another replica).

Forgotten runtimes
------------------
A dead runtime's registration outlives it, detached. The pruner deletes
those detached for longer than `KEEL_RUNTIME_RETENTION_MS` and holding no
lease, so rolling upgrades do not pile up in `status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Callable

from kernel.errors import UnknownRuntime
from kernel.registry import RegistryStore
from kernel.store import LeaseStore, now_ms
from services.common.errors import KeelError
from services.common.outage_log import OutageLog

log = logging.getLogger(__name__)


class Attachments:
    """The Attach streams open in this kernel process, by runtime."""

    def __init__(self, leases: LeaseStore, registry: RegistryStore, heartbeat_ms: int) -> None:
        self._leases = leases
        self._registry = registry
        self._heartbeat_s = heartbeat_ms / 1000
        self._streams: Counter[str] = Counter()
        self._draining = asyncio.Event()
        self._pending: set[asyncio.Task[None]] = set()
        # Runtimes whose leases were expired by a disconnect, in order.
        self.takeovers: list[tuple[str, list[str]]] = []

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def attached(self, runtime_id: str) -> bool:
        return self._streams[runtime_id] > 0

    def runtime_ids(self) -> list[str]:
        """The runtimes with a stream open here (kernel.liveness beats them)."""
        return [runtime_id for runtime_id, count in self._streams.items() if count > 0]

    async def stream(
        self, runtime_id: str, on_end: Callable[[Callable[[], None]], None] | None = None
    ) -> AsyncGenerator[int, None]:
        """Yields the server time now and every heartbeat until drained.

        The stream's end triggers the takeover. The generator's own end is
        not enough to see it: a server that drops a response generator
        suspended at a `yield` (the RPC ended while a heartbeat was being
        sent) leaves it to the garbage collector, and the runtime's leases
        waited for their TTL. So the caller also hands `on_end` a function
        to call when the RPC itself terminates (gRPC's done callback);
        whichever comes first ends the attachment, once.
        """
        if not await asyncio.to_thread(self._registry.exists, runtime_id):
            raise UnknownRuntime(f"runtime {runtime_id!r} is not registered")
        end = self._open(runtime_id)
        if on_end is not None:
            on_end(end)
        try:
            await asyncio.to_thread(self._registry.set_attached, runtime_id, True)
            yield now_ms()
            while not self._draining.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._draining.wait(), self._heartbeat_s)
                if not self._draining.is_set():
                    yield now_ms()
        finally:
            end()

    def _open(self, runtime_id: str) -> Callable[[], None]:
        """Counts one stream of `runtime_id`; returns its end, which may be
        called from any thread, any number of times (it acts once)."""
        loop = asyncio.get_running_loop()
        self._streams[runtime_id] += 1
        ended = False

        def end_here() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            # Nothing awaited here: this may run inside a cancelled handler.
            self._streams[runtime_id] -= 1
            if self._streams[runtime_id] <= 0:
                del self._streams[runtime_id]
                if not self._draining.is_set():
                    task = loop.create_task(self._detached(runtime_id))
                    self._pending.add(task)
                    task.add_done_callback(self._pending.discard)

        def end() -> None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                end_here()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(end_here)

        return end

    async def _detached(self, runtime_id: str) -> None:
        # A runtime that re-attached meanwhile (a reconnect) is alive.
        if self.attached(runtime_id):
            return
        try:
            freed = await asyncio.to_thread(self._leases.expire_runtime, runtime_id)
            if not self.attached(runtime_id):
                with contextlib.suppress(UnknownRuntime):
                    await asyncio.to_thread(self._registry.set_attached, runtime_id, False)
        except KeelError as error:
            # The store is down: the TTL will expire these leases instead.
            log.warning("could not expire the leases of %s: %s", runtime_id, error)
            return
        if freed:
            self.takeovers.append((runtime_id, freed))
            log.info("runtime %s disconnected; expired %d lease(s)", runtime_id, len(freed))

    def drain(self) -> None:
        """Ends every stream without expiring anything (this kernel stops)."""
        self._draining.set()

    async def close(self) -> None:
        self.drain()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


async def _periodically(interval_s: float, chore: Callable[[], int], what: str, done: str) -> None:
    """Runs a store chore every `interval_s` on a worker thread, forever.

    A store error (the database away) is logged and retried next time: a
    kernel's housekeeping must outlive an outage. `done` is logged, with the
    chore's count, when it did something.
    """
    outage = OutageLog(log, "kernel database", attempts=f"attempts of {what} failed")
    while True:
        await asyncio.sleep(interval_s)
        try:
            count = await asyncio.to_thread(chore)
        except KeelError as error:
            outage.failed(error)  # said once per outage, not every time
            continue
        outage.succeeded()
        if count:
            log.info(done, count)


class Sweeper:
    """Expires leases past their TTL, periodically."""

    def __init__(self, leases: LeaseStore, interval_ms: int) -> None:
        self._leases = leases
        self._interval_s = interval_ms / 1000

    async def run(self) -> None:
        await _periodically(
            self._interval_s,
            self._leases.sweep,
            "lease sweep",
            "expired %d lease(s) past their TTL",
        )


class RuntimePruner:
    """Forgets runtimes gone for longer than the retention, periodically."""

    def __init__(self, registry: RegistryStore, retention_ms: int, interval_ms: int) -> None:
        self._registry = registry
        self._retention_ms = retention_ms
        self._interval_s = interval_ms / 1000

    async def run(self) -> None:
        await _periodically(
            self._interval_s,
            lambda: self._registry.prune(self._retention_ms),
            "runtime pruning",
            f"forgot %d runtime(s) gone for over {self._retention_ms} ms",
        )
