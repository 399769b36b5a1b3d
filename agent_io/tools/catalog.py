"""The runner's tool registries: one per tenant and loadout revision.

Every attempt of a tenant on the same loadout revision shares one registry,
so a source is opened (an MCP child started, a gRPC channel made) and its
tools listed once per revision, not once per attempt. Nothing is shared
between tenants: not a registry, a source instance, an MCP child process or
a listing, even when two tenants' loadouts are identical.

When an attempt uses a newer revision of a tenant's loadout, the older
revisions are retired: their sources are closed as soon as no attempt uses
them any more (at once if none does). `aclose()` closes every source; the
runtime calls it when it drains or shuts down. A later attempt may still
use the catalog: it opens its sources again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from agent_io.loadout import Loadout
from agent_io.tools.registry import SourceSlot, ToolRegistry

__all__ = ["SlotBuilder", "ToolCatalog"]

log = logging.getLogger(__name__)

# Builds the slots of one tenant's loadout revision (new instances each call).
SlotBuilder = Callable[[str, Loadout], Sequence[SourceSlot]]


@dataclass(eq=False)
class _Entry:
    tenant_id: str
    revision: int
    registry: ToolRegistry
    users: int = 0
    # A newer revision of the tenant is in use: close once unused.
    retired: bool = False


class ToolCatalog:
    """Registries by (tenant, loadout revision), with their sources' lifetimes."""

    def __init__(self, build: SlotBuilder) -> None:
        self._build = build
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._latest: dict[str, int] = {}
        self._closing: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def registry(self, tenant_id: str, loadout: Loadout) -> AsyncIterator[ToolRegistry]:
        """The registry of `tenant_id`'s loadout revision, held while the
        block runs (its sources stay open until it ends)."""
        entry = self._acquire(tenant_id, loadout)
        try:
            yield entry.registry
        finally:
            self._release(entry)

    def revisions(self, tenant_id: str) -> tuple[int, ...]:
        """The revisions of `tenant_id` with a registry kept now."""
        return tuple(sorted(r for t, r in self._entries if t == tenant_id))

    def _acquire(self, tenant_id: str, loadout: Loadout) -> _Entry:
        revision = loadout.revision
        latest = self._latest.get(tenant_id)
        if latest is None or revision > latest:
            self._latest[tenant_id] = latest = revision
            for entry in [e for e in self._entries.values() if e.tenant_id == tenant_id]:
                if entry.revision < revision:
                    entry.retired = True
                    if entry.users == 0:
                        self._retire(entry)
        kept = self._entries.get((tenant_id, revision))
        if kept is None:
            slots = self._build(tenant_id, loadout)
            # Older than one in use already (a read that raced a write):
            # served, then closed when its attempt ends.
            kept = _Entry(tenant_id, revision, ToolRegistry(slots), retired=revision < latest)
            self._entries[(tenant_id, revision)] = kept
        kept.users += 1
        return kept

    def _release(self, entry: _Entry) -> None:
        entry.users -= 1
        if entry.users == 0 and entry.retired:
            self._retire(entry)

    def _retire(self, entry: _Entry) -> None:
        """Forgets the entry and closes its sources in the background (an
        MCP child may take a moment to exit; no attempt waits for it)."""
        key = (entry.tenant_id, entry.revision)
        if self._entries.get(key) is entry:
            del self._entries[key]
        task = asyncio.get_running_loop().create_task(
            _close_slots(entry.registry.slots), name=f"close-tools-{key[0]}-{key[1]}"
        )
        self._closing.add(task)
        task.add_done_callback(self._closed)

    def _closed(self, task: asyncio.Task[None]) -> None:
        self._closing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("closing tool sources failed", exc_info=task.exception())

    async def aclose(self) -> None:
        """Closes every source of every registry, and waits for every close
        under way. The closes run on tasks of their own: a caller that is
        cancelled meanwhile leaves them running, and the next call waits."""
        for entry in list(self._entries.values()):
            self._retire(entry)
        self._latest.clear()
        if self._closing:
            await asyncio.wait(set(self._closing))


async def _close_slots(slots: Sequence[SourceSlot]) -> None:
    # SourceSlot.aclose logs its own failures; none stops the others.
    await asyncio.gather(*(slot.aclose() for slot in slots))
