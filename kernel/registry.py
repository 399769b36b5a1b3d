"""The runtime registry and its audit: `runtime_instances` and `handoffs`.

A runtime (a runner or edge process) registers when it starts, holds an
Attach stream while it lives, and may be drained. Handoffs between runtimes
(rolling upgrades) are appended to an audit table that is never rewritten.

A process that dies leaves its row behind, detached. Every pod of every
rolling upgrade would stay listed forever, so rows detached (or never
attached) for longer than a retention period, and holding no lease, are
pruned. `seen_at_ms` is when a row last registered, attached or detached,
and is refreshed while the runtime stays attached (`touch`, and every
heartbeat of kernel.liveness, whose search for dead runtimes also clears
`attached` within seconds of a death no kernel saw): a row still marked
attached but not seen for `STALE_AFTER_MS` is listed as detached regardless.

A handoff row is written by the release that hands a session off (in the
release's transaction, `insert_handoff`) with no new runtime yet; the
claim that takes the session next fills it in (`name_successor`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernel.database import Database, Tx
from kernel.domain import DrainMode
from kernel.errors import UnknownRuntime
from kernel.handoffs import HandoffNote, insert_handoff
from kernel.store import Clock, now_ms

# A runtime attached to a kernel is touched at least every TOUCH_MS (every
# heartbeat of kernel.liveness, in fact); one not seen for
# STALE_AFTER_MS is listed as detached whatever its row says.
TOUCH_MS = 10_000
STALE_AFTER_MS = 3 * TOUCH_MS


@dataclass(frozen=True)
class RuntimeInfo:
    runtime_id: str
    address: str
    host: str
    pid: int
    loadout_revision: int
    version: str
    role: str
    # "none", "handoff" or "shutdown".
    drain_mode: str
    attached: bool
    # Sessions whose live lease this runtime holds.
    session_ids: tuple[str, ...]
    started_at_ms: int
    # The tenant of each of `session_ids`, in the same order.
    session_tenant_ids: tuple[str, ...] = ()
    # When the kernel last heard of it (0: unknown).
    seen_at_ms: int = 0
    # Its Attach stream is held by the kernel that listed it (False: by
    # another kernel, or by none). A runtime attached to another kernel may
    # be alive where this kernel's edges cannot dial it (another node).
    attached_here: bool = False


@dataclass(frozen=True)
class HandoffInfo:
    handoff_id: int
    old_runtime_id: str
    new_runtime_id: str
    loadout_revision: int
    in_flight: int
    session_id: str
    epoch: int
    at_ms: int


@dataclass(frozen=True)
class Registration:
    runtime_id: str
    address: str = ""
    host: str = ""
    pid: int = 0
    loadout_revision: int = 0
    version: str = ""
    role: str = "runner"


class RegistryStore:
    def __init__(self, database: Database, clock: Clock = now_ms) -> None:
        self._db = database
        self._clock = clock

    def register(self, registration: Registration) -> None:
        """Upserts the runtime. A new process (another pid) starts undrained;
        the same process re-registering (after a kernel restart) keeps its
        drain mode, so a drain is never undone by a reconnect."""
        r = registration

        def work(tx: Tx) -> None:
            now = self._clock()
            row = tx.one(
                "SELECT pid, drain_mode, started_at_ms FROM runtime_instances "
                "WHERE runtime_id = %s {lock}",
                (r.runtime_id,),
            )
            if row is None:
                tx.execute(
                    "INSERT INTO runtime_instances (runtime_id, address, host, pid, "
                    "loadout_revision, version, role, drain_mode, attached, started_at_ms, "
                    "seen_at_ms) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 0, %s, %s)",
                    (
                        r.runtime_id,
                        r.address,
                        r.host,
                        r.pid,
                        r.loadout_revision,
                        r.version,
                        r.role,
                        DrainMode.NONE.value,
                        now,
                        now,
                    ),
                )
                return
            same_process = int(row[0]) == r.pid
            tx.execute(
                "UPDATE runtime_instances SET address = %s, host = %s, pid = %s, "
                "loadout_revision = %s, version = %s, role = %s, drain_mode = %s, "
                "started_at_ms = %s, seen_at_ms = %s WHERE runtime_id = %s",
                (
                    r.address,
                    r.host,
                    r.pid,
                    r.loadout_revision,
                    r.version,
                    r.role,
                    row[1] if same_process else DrainMode.NONE.value,
                    int(row[2]) if same_process else now,
                    now,
                    r.runtime_id,
                ),
            )

        self._db.run(work)

    def _update(self, runtime_id: str, assignments: str, values: tuple[object, ...]) -> None:
        def work(tx: Tx) -> None:
            changed = tx.execute(
                f"UPDATE runtime_instances SET {assignments} WHERE runtime_id = %s",
                (*values, runtime_id),
            )
            if changed == 0:
                raise UnknownRuntime(f"runtime {runtime_id!r} is not registered")

        self._db.run(work)

    def set_attached(self, runtime_id: str, attached: bool) -> None:
        # A runtime's retention period runs from its last detach. Attaching
        # is also a heartbeat (kernel.liveness), or another kernel could take
        # a re-attached runtime's old, stale beat for a death.
        assignments = "attached = %s, seen_at_ms = %s"
        if attached:
            assignments += ", beat_at_ms = {db_now_ms}"
        self._update(runtime_id, assignments, (int(attached), self._clock()))

    def set_drain(self, runtime_id: str, mode: DrainMode) -> None:
        self._update(runtime_id, "drain_mode = %s", (mode.value,))

    def touch(self, runtime_id: str) -> None:
        """The runtime is still attached (its liveness, see STALE_AFTER_MS)."""
        self._update(runtime_id, "seen_at_ms = %s", (self._clock(),))

    def prune(self, retention_ms: int) -> int:
        """Deletes the runtimes detached (or never attached) for longer than
        `retention_ms` that hold no lease; returns how many it deleted."""
        cutoff = self._clock() - retention_ms
        # A lease still held (its TTL not yet swept) keeps its holder listed,
        # so `status` never shows a session held by a runtime it cannot name.
        return self._db.run(
            lambda tx: tx.execute(
                "DELETE FROM runtime_instances WHERE attached = 0 AND seen_at_ms < %s "
                "AND NOT EXISTS (SELECT 1 FROM kernel_sessions s WHERE s.state = 'held' "
                "AND s.runtime_id = runtime_instances.runtime_id)",
                (cutoff,),
            )
        )

    def exists(self, runtime_id: str) -> bool:
        row = self._db.run(
            lambda tx: tx.one(
                "SELECT 1 FROM runtime_instances WHERE runtime_id = %s", (runtime_id,)
            ),
            write=False,
        )
        return row is not None

    def record_handoff(
        self,
        old_runtime_id: str,
        new_runtime_id: str,
        loadout_revision: int,
        in_flight: int,
        session_id: str,
        epoch: int,
    ) -> int:
        note = HandoffNote(in_flight=in_flight, loadout_revision=loadout_revision)
        return self._db.run(
            lambda tx: insert_handoff(
                tx, old_runtime_id, new_runtime_id, note, session_id, epoch, self._clock()
            )
        )

    def list_runtimes(
        self,
        held_by: Callable[[], dict[str, list[tuple[str, str]]]],
        stale_after_ms: int = STALE_AFTER_MS,
        attached_here: Callable[[str], bool] = lambda runtime_id: False,
    ) -> list[RuntimeInfo]:
        """Every registered runtime; `attached_here` tells the runtimes whose
        Attach stream the listing kernel holds itself."""
        rows = self._db.run(
            lambda tx: tx.rows(
                "SELECT runtime_id, address, host, pid, loadout_revision, version, role, "
                "drain_mode, attached, started_at_ms, seen_at_ms FROM runtime_instances "
                "ORDER BY runtime_id"
            ),
            write=False,
        )
        sessions = held_by()
        fresh_since = self._clock() - stale_after_ms
        return [
            RuntimeInfo(
                runtime_id=row[0],
                address=row[1],
                host=row[2],
                pid=int(row[3]),
                loadout_revision=int(row[4]),
                version=row[5],
                role=row[6],
                drain_mode=row[7],
                attached=bool(row[8]) and int(row[10]) >= fresh_since,
                session_ids=tuple(session for session, _ in sessions.get(row[0], ())),
                started_at_ms=int(row[9]),
                session_tenant_ids=tuple(tenant for _, tenant in sessions.get(row[0], ())),
                seen_at_ms=int(row[10]),
                attached_here=attached_here(row[0]),
            )
            for row in rows
        ]

    def list_handoffs(self, limit: int) -> list[HandoffInfo]:
        """The newest `limit` handoffs, newest first."""
        rows = self._db.run(
            lambda tx: tx.rows(
                "SELECT handoff_id, old_runtime_id, new_runtime_id, loadout_revision, "
                "in_flight, session_id, epoch, at_ms FROM handoffs "
                "ORDER BY handoff_id DESC LIMIT %s",
                (limit,),
            ),
            write=False,
        )
        return [
            HandoffInfo(
                handoff_id=int(r[0]),
                old_runtime_id=r[1],
                new_runtime_id=r[2],
                loadout_revision=int(r[3]),
                in_flight=int(r[4]),
                session_id=r[5],
                epoch=int(r[6]),
                at_ms=int(r[7]),
            )
            for r in rows
        ]
