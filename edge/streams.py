"""One SSE stream per client: the session's facts, plus its owner's partials.

Facts come from the ledger's `Subscribe` from the client's cursor: the
backlog first, then live facts, in seq order, each with `id: <seq>`, so a
reconnect with `Last-Event-ID` resumes at cursor+1 with nothing missed or
repeated. Partials (`delta`, `status`) come from the runner that owns the
session, have no id (they are never facts), and start only once the backlog
has been sent. When the owner changes (takeover, handoff) the stream attaches
to the new owner by itself, prompted by the `epoch_started` fact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import ServerSentEvent

from edge.gateway import Gateway
from services.common.errors import KeelError
from services.ledger import CommittedFact
from services.runner.hub import Partial, StatusChange

log = logging.getLogger("keel.edge.sse")

_STATES = {"idle", "running", "compacting"}


def fact_event(fact: CommittedFact) -> ServerSentEvent:
    return ServerSentEvent(
        data=json.dumps(fact_json(fact), ensure_ascii=False, separators=(",", ":")),
        event=fact.kind,
        id=str(fact.seq),
    )


def fact_json(fact: CommittedFact) -> dict[str, Any]:
    return {
        "seq": fact.seq,
        "kind": fact.kind,
        "timestamp": fact.timestamp_ms,
        "epoch": fact.epoch,
        "data": fact.data,
    }


class SessionStream:
    def __init__(self, gateway: Gateway, session_id: str, after: int, head: int) -> None:
        self._gateway = gateway
        self._session_id = session_id
        self._after = after
        # Partials start once the client has every fact up to this head.
        self._head = head
        self._out: asyncio.Queue[ServerSentEvent | None] = asyncio.Queue(maxsize=4096)
        self._owner_changed = asyncio.Event()
        if after >= head:
            # Nothing to replay: attach to the current owner straight away.
            self._head = 0
            self._owner_changed.set()

    async def events(self) -> AsyncIterator[ServerSentEvent]:
        facts = asyncio.create_task(self._follow_facts(), name="sse-facts")
        partials = asyncio.create_task(self._follow_partials(), name="sse-partials")
        drained = asyncio.create_task(self._gateway.draining.wait(), name="sse-drain")
        get: asyncio.Task[ServerSentEvent | None] | None = None
        try:
            while True:
                get = asyncio.create_task(self._out.get())
                done, _ = await asyncio.wait({get, drained}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    item = get.result()
                    if item is None:
                        return
                    yield item
                    continue
                get.cancel()
                retry = self._gateway.config.drain_retry_after_ms
                yield ServerSentEvent(data=json.dumps({"retry_after_ms": retry}), event="drain")
                return
        finally:
            # The client may leave at any await: cancel everything we started.
            tasks = [facts, partials, drained, *([get] if get is not None else [])]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow_facts(self) -> None:
        try:
            async for fact in self._gateway.fanout.facts(self._session_id, self._after):
                await self._out.put(fact_event(fact))
                if fact.seq >= self._head:
                    self._head = 0  # the backlog is out: partials may flow
                    self._owner_changed.set()
                if fact.kind == "epoch_started":
                    self._owner_changed.set()
        except KeelError as error:
            log.info("fact stream of %s ended: %s", self._session_id, error)
        await self._out.put(None)

    async def _follow_partials(self) -> None:
        """Attach to the owner's hub; re-attach whenever the owner changes."""
        while True:
            await self._owner_changed.wait()
            self._owner_changed.clear()
            if self._head:
                continue
            owner = await self._gateway.owner(self._session_id)
            runner = await self._gateway.runner(owner) if owner else None
            if runner is None:
                continue
            with contextlib.suppress(KeelError):
                async for event in runner.watch(self._session_id):
                    if isinstance(event, Partial):
                        payload = {
                            "generationId": event.generation_id,
                            "channel": event.channel,
                            "text": event.text,
                        }
                        await self._put_partial(
                            ServerSentEvent(data=json.dumps(payload), event="delta")
                        )
                    elif isinstance(event, StatusChange) and event.state in _STATES:
                        data = json.dumps({"state": event.state, "epoch": event.epoch})
                        await self._put_partial(ServerSentEvent(data=data, event="status"))
            # The owner let go of the session: the client sees it idle.
            await self._put_partial(
                ServerSentEvent(data=json.dumps({"state": "idle"}), event="status")
            )

    async def _put_partial(self, event: ServerSentEvent) -> None:
        # A slow client loses partials, never facts.
        with contextlib.suppress(asyncio.QueueFull):
            self._out.put_nowait(event)
