"""Runtime heartbeats every kernel can read: takeover after losing a node.

The fast takeover (kernel.expiry) needs the kernel holding a runtime's
Attach stream to see the stream end. When a whole node dies — the runtime
and that kernel together — no kernel sees anything, and the runtime's
sessions would wait for their lease TTL while `status` listed the dead
runtime as attached.

So each kernel writes a heartbeat for every runtime attached to it, every
`runtime_heartbeat_ms`: `runtime_instances.beat_at_ms`, one UPDATE for all
of them. Every kernel also looks, as often, for runtimes still marked
attached whose heartbeat is older than `runtime_dead_after_ms`: their
kernel stopped beating, so they died with it (or are cut off from every
kernel). Such a runtime's leases are expired at once (`expired_by =
"disconnect"`) and it is marked detached. Safe for the reason the fast path
is (kernel.expiry): the ledger fences every write by epoch, so a runtime
wrongly taken for dead can cost repeated work, never a conflicting fact.

Heartbeats are written and compared on the database's clock (`{db_now_ms}`),
never a kernel's own: kernels on hosts whose clocks disagree by seconds
would otherwise bury each other's live runtimes. A runtime attached to a
live kernel is beaten every interval and is never stale; the kernel that
holds its stream also never buries it itself. The death is re-checked under
the runtime's row lock in the transaction that expires its leases, so a
runtime that re-attached meanwhile (its attach is a beat) is left alone.

A kernel searches for the dead only once beats had `runtime_dead_after_ms`
to resume: after it starts (the runtimes of a restarted kernel re-attach)
and after its store was away (nobody could beat meanwhile), so neither a
kernel restart nor a database outage is mistaken for deaths.

Start-up: the runtimes recorded in this kernel's data dir (`keel up`'s own
runners, services.common.runtime_records) whose process is gone and whose
row still names that process are buried at once, without waiting for their
heartbeat to age: a restarted `keel up` takes its predecessor's sessions at
once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kernel.database import Database, Tx
from kernel.store import Clock, LeaseStore, now_ms
from services.common.errors import KeelError
from services.common.outage_log import OutageLog
from services.common.runtime_records import local_runtimes

log = logging.getLogger(__name__)

T = TypeVar("T")

_STALE = "attached = 1 AND beat_at_ms > 0 AND beat_at_ms < {db_now_ms} - %s"


class LivenessStore:
    """Heartbeats and burials in `runtime_instances`."""

    def __init__(self, database: Database, leases: LeaseStore, clock: Clock = now_ms) -> None:
        self._db = database
        self._leases = leases
        self._clock = clock

    def beat(self, runtime_ids: Sequence[str]) -> int:
        """Renews the heartbeat of `runtime_ids` (attached here); how many rows.

        Also marks them attached: a runtime another kernel buried during a
        stall of this one is listed as attached again by its next beat."""
        if not runtime_ids:
            return 0
        marks = ", ".join(["%s"] * len(runtime_ids))
        return self._db.run(
            lambda tx: tx.execute(
                "UPDATE runtime_instances SET attached = 1, beat_at_ms = {db_now_ms}, "
                f"seen_at_ms = %s WHERE runtime_id IN ({marks})",
                (self._clock(), *sorted(runtime_ids)),
            )
        )

    def stale(self, dead_after_ms: int) -> list[str]:
        """Runtimes marked attached whose heartbeat is older than `dead_after_ms`."""
        rows = self._db.run(
            lambda tx: tx.rows(
                f"SELECT runtime_id FROM runtime_instances WHERE {_STALE} ORDER BY runtime_id",
                (dead_after_ms,),
            ),
            write=False,
        )
        return [row[0] for row in rows]

    def bury_stale(self, runtime_id: str, dead_after_ms: int) -> list[str]:
        """Expires the leases of `runtime_id` and detaches it, if its heartbeat
        is still stale under its row lock; the sessions it freed."""
        return self._bury(
            runtime_id,
            f"SELECT 1 FROM runtime_instances WHERE runtime_id = %s AND {_STALE} {{lock}}",
            (runtime_id, dead_after_ms),
        )

    def bury_process(self, runtime_id: str, pid: int) -> list[str]:
        """Like `bury_stale`, for a runtime known dead by its process id on
        this host: only while its row still names that process on this host
        (not a successor's, nor a process of a host sharing the data dir)."""
        return self._bury(
            runtime_id,
            "SELECT 1 FROM runtime_instances WHERE runtime_id = %s AND pid = %s "
            "AND host = %s AND attached = 1 {lock}",
            (runtime_id, pid, socket.gethostname()),
        )

    def _bury(self, runtime_id: str, check: str, params: tuple[object, ...]) -> list[str]:
        def dead(tx: Tx, now: int) -> bool:
            if tx.one(check, params) is None:
                return False
            tx.execute(
                "UPDATE runtime_instances SET attached = 0, seen_at_ms = %s WHERE runtime_id = %s",
                (now, runtime_id),
            )
            return True

        return self._leases.expire_runtime(runtime_id, dead)

    def bury_gone_processes(self, data_dir: Path) -> dict[str, list[str]]:
        """Buries the runtimes recorded under `data_dir` whose process is gone."""
        buried: dict[str, list[str]] = {}
        for record in local_runtimes(data_dir):
            if not record.alive():
                buried[record.runtime_id] = self.bury_process(record.runtime_id, record.pid)
        return buried


class Heartbeats:
    """This kernel's heartbeat for its attached runtimes, and the search for
    dead ones, every `interval_ms`.

    Store calls run on a thread of their own, so a busy default executor (a
    burst of claims) never delays a heartbeat into a false death.
    """

    def __init__(
        self,
        liveness: LivenessStore,
        attached: Callable[[], list[str]],
        interval_ms: int,
        dead_after_ms: int,
    ) -> None:
        self._liveness = liveness
        self._attached = attached
        self._interval_s = interval_ms / 1000
        self._dead_after_ms = dead_after_ms
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-heartbeat")
        # Said once per outage of the store, not every round.
        self._outage = OutageLog(log, "kernel database", attempts="runtime heartbeats failed")
        # Rounds completed (beat and search both done), for observers.
        self.rounds = 0
        # The runtimes buried here with the sessions each freed, in order.
        self.buried: list[tuple[str, list[str]]] = []

    async def _call(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        # No search for the dead until beats had time to resume: after this
        # kernel starts (runtimes of a restarted kernel re-attach to it) and
        # after the store was away (no kernel could beat meanwhile).
        search_from = loop.time() + self._dead_after_ms / 1000
        try:
            while True:
                try:
                    await self.round(search=loop.time() >= search_from)
                except KeelError as error:
                    # The store is away: the lease TTL still bounds the wait.
                    self._outage.failed(error)
                    search_from = loop.time() + self._dead_after_ms / 1000
                else:
                    self._outage.succeeded()
                await asyncio.sleep(self._interval_s)
        finally:
            self._executor.shutdown(wait=False)

    async def round(self, search: bool = True) -> None:
        """Beats for the runtimes attached here; with `search`, buries the
        runtimes whose beat stopped."""
        mine = self._attached()
        await self._call(lambda: self._liveness.beat(mine))
        if search:
            await self._bury_stale()
        self.rounds += 1

    async def _bury_stale(self) -> None:
        stale = await self._call(lambda: self._liveness.stale(self._dead_after_ms))
        for runtime_id in stale:
            # Its stream is open here: alive, whatever a slow beat says.
            if runtime_id in self._attached():
                continue
            bury = functools.partial(self._liveness.bury_stale, runtime_id, self._dead_after_ms)
            freed = await self._call(bury)
            if freed:
                log.info("runtime %s stopped beating; expired %d lease(s)", runtime_id, len(freed))
                self.buried.append((runtime_id, freed))
