"""The kernel's gRPC face: validation, long-polling claims, Attach streams.

Every request is validated here (ids, epochs, waits, documents; the checks
are kernel.rpc_checks) and turned into a clear INVALID_ARGUMENT before it
reaches a store; store calls run in worker threads so a slow database never
blocks the event loop. This module holds the runtime and lease calls; the
tenancy calls (tenants, keys, loadouts) are kernel.tenancy_rpcs, a base of
`KernelServicer`, where a loadout is checked against the schema and then,
with its tenant's id, against the operator's `SecretPolicy`
(kernel.loadout_secrets).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from keel.kernel.v1 import kernel_pb2 as pb
from keel.kernel.v1 import kernel_pb2_grpc as pb_grpc
from kernel.codec import (
    DRAIN_FROM_PB,
    FAILURE_FROM_PB,
    finish_result_to_pb,
    handoff_to_pb,
    lease_info_to_pb,
    lease_to_pb,
    runtime_to_pb,
)
from kernel.config import KernelConfig
from kernel.domain import DrainMode, FailureKind, Lease, check_id, default_loadout
from kernel.errors import InvalidArgument
from kernel.expiry import Attachments
from kernel.handoffs import HandoffNote
from kernel.lease_stream_server import KnownLoadout, LeaseStreamSession
from kernel.registry import Registration, RegistryStore
from kernel.revocations import RevocationFeed
from kernel.rpc_checks import (
    MAX_TEXT,
    Context,
    bounded_text,
    non_negative,
    optional_id,
    positive_epoch,
)
from kernel.schedule_rpcs import ScheduleRpcs
from kernel.schedule_store import ScheduleStore
from kernel.sticky import WakeRoutes, WakeTarget, granted_ms
from kernel.store import Claimed, LeaseStore
from kernel.tenancy import TenantStore
from kernel.tenancy_rpcs import TenancyRpcs
from kernel.waker import ClaimWaker
from services.common import tracing
from services.common.errors import stream_errors, unary_errors
from services.common.secrets import SecretPolicy
from services.common.serving import GrpcService

log = logging.getLogger(__name__)

# A claim may wait at most this long; longer waits are a caller's bug.
MAX_WAIT_MS = 300_000
MAX_HANDOFFS = 1000
# Threads of Enqueue's own: an input's acceptance does not queue behind the
# claims, finishes and renewals of a run backlog in the default executor.
# With that executor's threads and the heartbeat's, within the store's pool.
ENQUEUE_THREADS = 4
# The most of an Enqueue's facts a wake carries on; past it the runner reads
# them (a large input costs a Read, not the stream's message budget).
MAX_WAKE_FACTS_BYTES = 64 * 1024


def _on_done(context: Context, callback: Callable[[], None]) -> None:
    """Calls `callback` when the RPC of `context` terminates, however it ends."""
    # grpc-stubs declare a done callback as a class; grpc calls any callable.
    context.add_done_callback(lambda _: callback())  # type: ignore[arg-type]


class KernelServicer(TenancyRpcs, ScheduleRpcs, pb_grpc.KernelServiceServicer):
    """`keel.kernel.v1.KernelService`: the kernel's whole gRPC surface.

    Owns nothing durable itself: leases, the queue and admission are the
    `LeaseStore`'s, runner instances and their drain modes the
    `RegistryStore`'s, tenants, keys and loadouts the `TenantStore`'s. It
    owns the process's live state around them: the open Attach streams
    (`Attachments`), the waiting claims (`ClaimWaker`), the revocation feed
    edges watch and the wake routes of sticky sessions.

    Built by `kernel.server`; called over gRPC by `KernelClient` (runners,
    edges, the compaction service, the CLI).
    """

    def __init__(
        self,
        leases: LeaseStore,
        registry: RegistryStore,
        tenants: TenantStore,
        attachments: Attachments,
        waker: ClaimWaker,
        config: KernelConfig,
        *,
        schedules: ScheduleStore,
        secrets: SecretPolicy | None = None,
    ) -> None:
        self._leases = leases
        self._schedules = schedules
        self._registry = registry
        self._tenants = tenants
        self._attachments = attachments
        self._waker = waker
        self._recheck_s = config.recheck_ms / 1000
        # The operator's grants (Settings.secrets); by default none, so a
        # loadout may name no secret at all.
        self._secrets = secrets or SecretPolicy()
        self._revocations = RevocationFeed(tenants)
        # Releases of leases whose claimer went away (see _claim_once).
        self._handing_back: set[asyncio.Future[None]] = set()
        # Set on drain: LeaseStreams answer what they have read, then end.
        self._streams_end = asyncio.Event()
        self._enqueues = ThreadPoolExecutor(ENQUEUE_THREADS, thread_name_prefix="keel-enqueue")
        # Runners keeping sticky sessions, by the LeaseStream that reaches them.
        self.wake_routes = WakeRoutes()

    async def drain(self) -> None:
        self._attachments.drain()
        self._streams_end.set()
        # Waiting claims give up at once rather than holding the shutdown.
        self._waker.wake()
        # Edges watching revocations reconnect to another replica.
        await self._revocations.close()

    async def close(self) -> None:
        await self._revocations.close()
        if self._handing_back:
            await asyncio.gather(*self._handing_back, return_exceptions=True)
        self._enqueues.shutdown(wait=False)

    # -- runtimes --

    @unary_errors
    async def RegisterRuntime(
        self, request: pb.RegisterRuntimeRequest, context: Context
    ) -> pb.RegisterRuntimeResponse:
        registration = Registration(
            runtime_id=check_id(request.runtime_id, "runtime_id"),
            address=bounded_text(request.address, "address", 512),
            host=bounded_text(request.host, "host", 512),
            pid=non_negative(request.pid, "pid"),
            loadout_revision=non_negative(request.loadout_revision, "loadout_revision"),
            version=bounded_text(request.version, "version", 256),
            role=check_id(request.role or "runner", "role"),
        )
        await asyncio.to_thread(self._registry.register, registration)
        return pb.RegisterRuntimeResponse(lease_ttl_ms=self._leases.lease_ms)

    @stream_errors
    async def Attach(
        self, request: pb.AttachRequest, context: Context
    ) -> AsyncIterator[pb.AttachResponse]:
        runtime_id = check_id(request.runtime_id, "runtime_id")
        # The RPC's end (the peer gone), not only the generator's, ends the
        # attachment: see Attachments.stream. While it lasts, this kernel's
        # heartbeat (kernel.liveness) keeps the runtime's row alive.
        beats = self._attachments.stream(runtime_id, lambda end: _on_done(context, end))
        async for server_time in beats:
            yield pb.AttachResponse(server_time_ms=server_time)

    @unary_errors
    async def SetDrain(self, request: pb.SetDrainRequest, context: Context) -> pb.SetDrainResponse:
        runtime_id = check_id(request.runtime_id, "runtime_id")
        mode = DRAIN_FROM_PB.get(request.mode)
        if mode is None:
            raise InvalidArgument("mode must be NONE, HANDOFF or SHUTDOWN", field="mode")
        await asyncio.to_thread(self._registry.set_drain, runtime_id, mode)
        if mode is not DrainMode.NONE:
            # A draining runner keeps nothing: its sessions' next inputs are
            # claimed by the others at once (and it is granted no window).
            await asyncio.to_thread(self._leases.end_sticky, runtime_id=runtime_id)
        self._waker.wake()
        return pb.SetDrainResponse()

    @unary_errors
    async def RecordHandoff(
        self, request: pb.RecordHandoffRequest, context: Context
    ) -> pb.RecordHandoffResponse:
        handoff_id = await asyncio.to_thread(
            self._registry.record_handoff,
            check_id(request.old_runtime_id, "old_runtime_id"),
            optional_id(request.new_runtime_id, "new_runtime_id"),
            non_negative(request.loadout_revision, "loadout_revision"),
            non_negative(request.in_flight, "in_flight"),
            optional_id(request.session_id, "session_id"),
            non_negative(request.epoch, "epoch"),
        )
        return pb.RecordHandoffResponse(handoff_id=handoff_id)

    @unary_errors
    async def ListRuntimes(
        self, request: pb.ListRuntimesRequest, context: Context
    ) -> pb.ListRuntimesResponse:
        here = set(self._attachments.runtime_ids())
        runtimes = await asyncio.to_thread(
            self._registry.list_runtimes, self._leases.held_by, attached_here=here.__contains__
        )
        return pb.ListRuntimesResponse(runtimes=[runtime_to_pb(r) for r in runtimes])

    @unary_errors
    async def ListHandoffs(
        self, request: pb.ListHandoffsRequest, context: Context
    ) -> pb.ListHandoffsResponse:
        limit = non_negative(request.limit, "limit") or 100
        handoffs = await asyncio.to_thread(self._registry.list_handoffs, min(limit, MAX_HANDOFFS))
        return pb.ListHandoffsResponse(handoffs=[handoff_to_pb(h) for h in handoffs])

    # -- leases --
    # Each operation is one method that the unary RPC and LeaseStream share,
    # so the two cannot decide differently.

    @unary_errors
    async def Claim(self, request: pb.ClaimRequest, context: Context) -> pb.ClaimResponse:
        return await self.claim(request)

    async def claim(
        self, request: pb.ClaimRequest, stream: WakeTarget | None = None
    ) -> pb.ClaimResponse:
        """A claim on a LeaseStream (`stream`) makes that stream the way the
        runtime's wakes take: a session it keeps may have been settled by
        the ledger (kernel/turn_settlement.py), with no Finish to bind it.
        `stream.known(tenant, revision)`: the caller already has that
        document, so the answer leaves it out. Checked last, with no await
        after it, so a stream answers in the order it decided."""
        runtime_id = check_id(request.runtime_id, "runtime_id")
        if stream is not None:
            self.wake_routes.bind(runtime_id, stream)
        known = None if stream is None else stream.known
        wait_ms = non_negative(request.wait_ms, "wait_ms")
        if wait_ms > MAX_WAIT_MS:
            raise InvalidArgument(f"wait_ms must be at most {MAX_WAIT_MS}", field="wait_ms")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ms / 1000
        while True:
            # Taken before asking the store: a change committed after this
            # point wakes the wait below even if it raced the query.
            woken = self._waker.current()
            claimed = await self._claim_once(runtime_id, request.with_loadout)
            if claimed is not None:
                return await self._claimed(claimed, known)
            remaining = deadline - loop.time()
            if remaining <= 0 or self._attachments.draining:
                return pb.ClaimResponse()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), min(remaining, self._recheck_s))

    async def _claimed(self, claimed: Claimed, known: KnownLoadout | None) -> pb.ClaimResponse:
        response = pb.ClaimResponse(lease=lease_to_pb(claimed.lease))
        revision = claimed.loadout_revision
        if revision is None:
            return response  # not asked for, or no such tenant: GetLoadout says why
        tenant_id = claimed.lease.tenant_id
        document = ""
        if known is None or not known(tenant_id, revision):
            # Revisions are never rewritten nor deleted: this reads the very
            # one the claim's transaction found latest (GetLoadout's 0 would
            # mean "the latest now", which may be newer: 0 is the default).
            if revision == 0:
                stored = default_loadout()
            else:
                loadout = await asyncio.to_thread(self._tenants.get_loadout, tenant_id, revision)
                stored = loadout.document
            document = json.dumps(stored, ensure_ascii=False)
            # Another answer may have sent it while this one read it: harmless.
        response.loadout.revision = revision
        response.loadout.document_json = document
        return response

    async def _claim_once(self, runtime_id: str, with_loadout: bool) -> Claimed | None:
        """One store claim. If the caller goes away while it runs (a client
        deadline, a dead peer, a withdrawn stream request), a lease it took
        is handed straight back instead of sitting unused until its TTL."""
        claiming = asyncio.ensure_future(
            asyncio.to_thread(self._leases.claim_with_loadout, runtime_id, with_loadout)
        )
        try:
            return await asyncio.shield(claiming)
        except asyncio.CancelledError:
            claiming.add_done_callback(self._hand_back)
            raise

    def _hand_back(
        self, claiming: asyncio.Future[Claimed | None] | asyncio.Future[Lease | None]
    ) -> None:
        if claiming.cancelled() or claiming.exception() is not None:
            return
        claimed = claiming.result()
        lease = claimed.lease if isinstance(claimed, Claimed) else claimed
        if lease is None:
            return
        release = asyncio.ensure_future(
            asyncio.to_thread(self._leases.release, lease.session_id, lease.epoch, lease.runtime_id)
        )
        self._handing_back.add(release)
        release.add_done_callback(self._handed_back)

    def _handed_back(self, release: asyncio.Future[None]) -> None:
        self._handing_back.discard(release)
        # A failed hand-back only means the lease lives until its TTL.
        if not release.cancelled() and release.exception() is not None:
            log.warning("could not hand back an abandoned claim: %s", release.exception())

    @unary_errors
    async def Renew(self, request: pb.RenewRequest, context: Context) -> pb.RenewResponse:
        return await self.renew(request)

    async def renew(self, request: pb.RenewRequest) -> pb.RenewResponse:
        expires = await asyncio.to_thread(
            self._leases.renew,
            check_id(request.session_id, "session_id"),
            positive_epoch(request.epoch),
            check_id(request.runtime_id, "runtime_id"),
        )
        return pb.RenewResponse(expires_at_ms=expires)

    @unary_errors
    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:
        return await self.release(request)

    async def release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        handoff = None
        if request.HasField("handoff"):
            handoff = HandoffNote(
                in_flight=non_negative(request.handoff.in_flight, "in_flight"),
                loadout_revision=non_negative(request.handoff.loadout_revision, "loadout_revision"),
            )
        await asyncio.to_thread(
            self._leases.release,
            check_id(request.session_id, "session_id"),
            positive_epoch(request.epoch),
            check_id(request.runtime_id, "runtime_id"),
            handoff,
        )
        return pb.ReleaseResponse()

    @unary_errors
    async def Finish(self, request: pb.FinishRequest, context: Context) -> pb.FinishResponse:
        return await self.finish(request)

    async def finish(
        self, request: pb.FinishRequest, stream: WakeTarget | None = None
    ) -> pb.FinishResponse:
        """A sticky window is granted only to a Finish on a LeaseStream
        (`stream`): that is the way its wake will take."""
        sticky_ms = 0
        if stream is not None and request.sticky_ms > 0:
            sticky_ms = granted_ms(request.sticky_ms)
            self.wake_routes.bind(check_id(request.runtime_id, "runtime_id"), stream)
        result = await asyncio.to_thread(
            self._leases.finish,
            check_id(request.session_id, "session_id"),
            positive_epoch(request.epoch),
            check_id(request.runtime_id, "runtime_id"),
            non_negative(request.read_through, "read_through"),
            request.outcome == pb.FINISH_OUTCOME_FAILED,
            request.error[:MAX_TEXT],
            FAILURE_FROM_PB.get(request.failure, FailureKind.RETRYABLE),
            non_negative(request.retry_after_ms, "retry_after_ms"),
            sticky_ms,
        )
        return finish_result_to_pb(result)

    async def LeaseStream(
        self, requests: AsyncIterator[pb.LeaseStreamRequest], context: Context
    ) -> AsyncIterator[pb.LeaseStreamResponse]:
        # Refusals are answers on the stream (kernel.lease_stream_server),
        # never the stream's status: one bad request ends nothing else.
        stream = LeaseStreamSession(self)
        try:
            async for answer in stream.serve(requests, self._streams_end):
                yield answer
        finally:
            self.wake_routes.unbind(stream)

    @unary_errors
    async def Enqueue(self, request: pb.EnqueueRequest, context: Context) -> pb.EnqueueResponse:
        tracing.annotate_current(
            {tracing.SESSION_ID: request.session_id, tracing.TENANT_ID: request.tenant_id}
        )
        enqueue = functools.partial(
            self._leases.enqueue,
            check_id(request.session_id, "session_id"),
            check_id(request.tenant_id, "tenant_id"),
            non_negative(request.input_seq, "input_seq"),
            request.unpark,
            self.wake_routes.reachable,
        )
        # In the caller's context, as asyncio.to_thread would run it (its span).
        run = functools.partial(contextvars.copy_context().run, enqueue)
        woken = await asyncio.get_running_loop().run_in_executor(self._enqueues, run)
        log.debug(
            "enqueue of %s at %d: %s",
            request.session_id,
            request.input_seq,
            "wake" if woken is not None else "queued",
        )
        if woken is not None:
            facts = request.facts if len(request.facts) <= MAX_WAKE_FACTS_BYTES else b""
            # Shielded: a caller that leaves now must not strand the woken
            # lease until its TTL (it is sent, or released).
            await asyncio.shield(self._send_wake(woken, facts))
        return pb.EnqueueResponse()

    async def _send_wake(self, woken: Claimed, facts: bytes) -> None:
        """Sends a woken lease (and the facts its input came with) to its
        holder's stream; one that ended since is handed back at once (anyone
        may claim the session then)."""
        lease = woken.lease
        route = self.wake_routes.get(lease.runtime_id)
        if route is not None:
            wake = await self._claimed(woken, route.known)
            wake.facts = facts
            if route.send_wake(wake):
                log.debug("wake of %s sent to %s", lease.session_id, lease.runtime_id)
                return
        log.info("wake of %s found no stream of %s: released", lease.session_id, lease.runtime_id)
        await asyncio.to_thread(
            self._leases.release, lease.session_id, lease.epoch, lease.runtime_id
        )
        self._waker.wake()

    @unary_errors
    async def GetLease(self, request: pb.GetLeaseRequest, context: Context) -> pb.GetLeaseResponse:
        info = await asyncio.to_thread(
            self._leases.get_lease, check_id(request.session_id, "session_id")
        )
        return lease_info_to_pb(info)


def kernel_service(servicer: KernelServicer) -> GrpcService:
    return GrpcService(
        name=pb.DESCRIPTOR.services_by_name["KernelService"].full_name,
        add_to_server=lambda server: pb_grpc.add_KernelServiceServicer_to_server(servicer, server),
        on_drain=servicer.drain,
    )
