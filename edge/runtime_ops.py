"""Runtime endpoints: drain runtimes and undo it (operators). What
`GET /v1/runtime/status` reports is edge.runtime_status.

A drain is scoped: one runtime named by id, or every attached runner of
the deployment (the kernel's registry), never the edges by default. The
edge that answers drains only when named (its own id) or through a local
drain (`keel drain --local` on its host). A drain that has not finished can
be undone; a finished one cannot (the runtime exits and is replaced).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from edge import metrics as edge_metrics
from edge.errors import Conflict, NotFound, Unavailable, from_service_error
from edge.gateway import Gateway
from kernel import RuntimeInfo
from kernel.domain import DrainMode
from services.common.errors import KeelError
from services.runner.client import DrainOutcome

# How often a draining edge looks whether its streams are gone.
STREAMS_POLL_S = 0.05
# A runner's drain answers by its deadline; this much more is its reply's way.
DRAIN_REPLY_GRACE_S = 10.0


class UnknownRuntime(NotFound):
    reason = "UNKNOWN_RUNTIME"


async def _named_runner(gateway: Gateway, runtime_id: str) -> RuntimeInfo:
    """The attached runner `runtime_id`, or the refusal saying why not."""
    found = next((r for r in await gateway.runtimes() if r.runtime_id == runtime_id), None)
    if found is None:
        raise UnknownRuntime(f"no runtime {runtime_id!r} is registered with the kernel")
    if found.role != "runner":
        raise Conflict(
            f"runtime {runtime_id!r} is an edge: drain it with `keel drain --local` on its host"
        )
    if not found.attached:
        raise Conflict(f"runtime {runtime_id!r} is not attached to the kernel: it is gone")
    return found


async def _attached_runners(gateway: Gateway) -> list[RuntimeInfo]:
    return [r for r in await gateway.runtimes() if r.role == "runner" and r.attached]


async def _runners_asked(gateway: Gateway, runtime_id: str | None) -> list[RuntimeInfo]:
    """The runner named (refused when it is not attached), or, with no name,
    every attached runner."""
    if runtime_id is not None:
        return [await _named_runner(gateway, runtime_id)]
    return await _attached_runners(gateway)


async def _call_drain(
    gateway: Gateway, runtime: RuntimeInfo, mode: DrainMode, deadline_ms: int
) -> DrainOutcome:
    """Drains (or, mode "none", undoes the drain of) one runner; a runner
    that cannot be reached raises Unavailable naming it."""
    runner = await gateway.runner(runtime.runtime_id)
    where = f"runtime {runtime.runtime_id} at {runtime.address or '(no address)'}"
    if runner is None:
        raise Unavailable(f"{where} registered no address to reach it at")
    try:
        return await asyncio.wait_for(
            runner.drain_outcome(mode, deadline_ms, runtime_id=runtime.runtime_id),
            deadline_ms / 1000 + DRAIN_REPLY_GRACE_S,
        )
    except TimeoutError:
        raise Unavailable(f"{where} did not answer its drain in time") from None
    except KeelError as error:
        raise Unavailable(f"{where}: {from_service_error(error).message}") from None


async def drain_runtimes(
    gateway: Gateway, mode: DrainMode, deadline_ms: int, runtime_id: str | None
) -> dict[str, Any]:
    """Drains the runtime named (a runner, or this edge), or every attached
    runner; returns once their drains have finished."""
    result: dict[str, Any] = {"mode": mode, "runtimes": {}, "stopped": {}, "failed": {}}
    result.update(undone=[], edge=None)
    if runtime_id == gateway.edge_id:
        result["edge"] = gateway.edge_id
        result["openStreams"] = await drain_this_edge(gateway, mode, deadline_ms)
        return result
    targets = await _runners_asked(gateway, runtime_id)

    async def one(runtime: RuntimeInfo) -> None:
        started = time.perf_counter()
        try:
            outcome = await _call_drain(gateway, runtime, mode, deadline_ms)
        except Unavailable as error:
            edge_metrics.drain_answered(mode, started, "failed")
            if runtime_id is not None:
                raise
            result["failed"][runtime.runtime_id] = error.message
            return
        edge_metrics.drain_answered(mode, started, "undone" if outcome.undone else "drained")
        result["runtimes"][runtime.runtime_id] = outcome.in_flight_runs
        result["stopped"][runtime.runtime_id] = outcome.stopped_runs
        if outcome.undone:
            result["undone"].append(runtime.runtime_id)

    # Runners stop claiming at once; a handoff waits for commit boundaries.
    await asyncio.gather(*(one(t) for t in targets))
    return result


async def undo_drains(gateway: Gateway, runtime_id: str | None) -> dict[str, Any]:
    """Undoes the unfinished drain of the runtime named, or of every
    attached runner draining and of this edge."""
    result: dict[str, Any] = {"undone": [], "finished": [], "failed": {}, "edge": None}
    if runtime_id == gateway.edge_id or runtime_id is None:
        if gateway.drained.is_set():
            if runtime_id is not None:
                raise Conflict("this edge has finished draining: it is being replaced")
        elif gateway.stop_draining():
            result["undone"].append(gateway.edge_id)
            result["edge"] = gateway.edge_id
        if runtime_id is not None:
            return result
    # Every attached runner is asked, not only those the kernel knows to be
    # draining: a drain just begun may not be registered yet.
    targets = await _runners_asked(gateway, runtime_id)

    async def one(runtime: RuntimeInfo) -> None:
        try:
            outcome = await _call_drain(gateway, runtime, DrainMode.NONE, 0)
        except Unavailable as error:
            if runtime_id is not None:
                raise
            result["failed"][runtime.runtime_id] = error.message
            return
        if outcome.finished:
            if runtime_id is not None:
                raise Conflict(
                    f"runtime {runtime_id} has finished its drain: it exits and is replaced"
                )
            result["finished"].append(runtime.runtime_id)
        elif outcome.undone:
            result["undone"].append(runtime.runtime_id)

    await asyncio.gather(*(one(t) for t in targets))
    return result


async def drain_this_edge(gateway: Gateway, mode: DrainMode, deadline_ms: int) -> int:
    """Drains this edge: every stream is told `drain` (SSE and gRPC), new
    ones are told at once, /readyz answers 503; finishes once the streams
    are gone or at the deadline, and returns how many were still open. A
    finished edge is replaced (a standalone one exits). An undo before the
    end leaves it serving."""
    gateway.start_draining(mode)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_ms / 1000

    def waiting() -> bool:
        return bool(gateway.fanout.clients) and gateway.draining.is_set()

    # Polled: the fan-out counts its clients but signals no "all gone".
    while waiting() and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(STREAMS_POLL_S)
    open_streams = gateway.fanout.clients
    if gateway.draining.is_set():
        gateway.drained.set()
    return open_streams
