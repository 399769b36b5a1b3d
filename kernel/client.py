"""`KernelClient`: the typed async client runners and the edge use.

Errors come back as the kernel's own exception classes (`EpochSuperseded`,
`LeaseLost`, `UnknownTenant`, …), so callers never inspect status codes.

This module holds the runtime and lease calls; the tenancy calls are
kernel/tenancy_client.py (a base of `KernelClient`) and a runtime's Attach
stream is kernel/attachment.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from keel.kernel.v1 import kernel_pb2 as pb
from keel.kernel.v1 import kernel_pb2_grpc as pb_grpc
from kernel.attachment import Attachment as Attachment  # re-exported: callers import it here
from kernel.codec import (
    DRAIN_TO_PB,
    FAILURE_TO_PB,
    finish_result_from_pb,
    handoff_from_pb,
    lease_from_pb,
    lease_info_from_pb,
    runtime_from_pb,
)
from kernel.domain import DrainMode, FailureKind, FinishResult, Lease, LeaseInfo
from kernel.errors import InvalidArgument, KernelError
from kernel.handoffs import HandoffNote
from kernel.lease_stream_client import (
    LeaseStreamClient,
    StreamBroken,
    StreamLink,
)
from kernel.registry import HandoffInfo, RuntimeInfo
from kernel.schedule_client import ScheduleCalls
from kernel.tenancy import LoadoutRevision
from kernel.tenancy_client import TenancyCalls
from services.common.config import Settings
from services.common.errors import KeelError
from services.common.rpc import balanced_target, replica_channel_options, unary
from services.common.serving import open_channel

# Extra time a long-polling claim gets beyond its wait before it is abandoned.
_CLAIM_GRACE_S = 30.0
# A renewal whose stream broke is sent again on a new one, about as the
# channel's retry policy resends an idempotent RPC (services.common.rpc).
_RENEW_ATTEMPTS = 5
_RENEW_RETRY_FIRST_S = 0.1

# Safe to resend to another replica after UNAVAILABLE (a Claim or Finish is
# not: the first may have taken effect).
_IDEMPOTENT_METHODS = (
    "Renew",
    "GetLease",
    "SetDrain",
    "ListRuntimes",
    "ListHandoffs",
    "Authenticate",
    "GetLoadout",
    "ListTenants",
    "ListApiKeys",
    "WatchRevocations",
)

R = TypeVar("R")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """A granted lease and the loadout its attempt runs."""

    lease: Lease
    # The tenant's latest loadout when the lease was granted; None when the
    # kernel could not say (no such tenant, or a kernel that predates it):
    # GetLoadout then tells.
    loadout: LoadoutRevision | None
    # A wake's: the facts its input came with, a packed page (the ledger's
    # encoding: services/ledger/packed_facts.py); empty when none came.
    facts: bytes = b""


class KernelClient(TenancyCalls, ScheduleCalls):
    """Async client of `keel.kernel.v1.KernelService`.

    Owns the channel (balanced over the kernel replicas a target lists), the
    Attach streams it opened (re-attached to another replica when one dies)
    and the lease stream its claims, renewals and finishes ride on.

    Called by the runner's `Runtime`, the edge's `Gateway`, the compaction
    server, `keel up` and the benchmarks.
    """

    def __init__(self, target: str, settings: Settings | None = None) -> None:
        # `target` may list kernel replicas ("host:port,host:port"); an
        # Attach stream broken by one replica's death re-attaches to another.
        self._channel = open_channel(
            balanced_target(target),
            settings or Settings(),
            replica_channel_options("keel.kernel.v1.KernelService", _IDEMPOTENT_METHODS),
        )
        self._stub = pb_grpc.KernelServiceStub(self._channel)
        self._attachments: list[Attachment] = []
        self._leases = LeaseStreamClient(self._stub)

    async def close(self) -> None:
        for attachment in self._attachments:
            await attachment.close()
        self._attachments.clear()
        await self._leases.close()
        await self._channel.close(None)

    async def __aenter__(self) -> KernelClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- runtimes --

    async def register_runtime(
        self,
        runtime_id: str,
        address: str = "",
        *,
        host: str = "",
        pid: int = 0,
        loadout_revision: int = 0,
        version: str = "",
        role: str = "runner",
    ) -> int:
        """Registers (or re-registers) a runtime; returns the lease TTL in ms."""
        request = pb.RegisterRuntimeRequest(
            runtime_id=runtime_id,
            address=address,
            host=host,
            pid=pid,
            loadout_revision=loadout_revision,
            version=version,
            role=role,
        )
        response = await unary(self._stub.RegisterRuntime(request), KernelError)
        return response.lease_ttl_ms

    def attach(
        self, runtime_id: str, reregister: Callable[[], Awaitable[object]] | None = None
    ) -> Attachment:
        """Starts holding the runtime's Attach stream (needs a running loop).

        With `reregister`, a runtime the kernel no longer knows registers
        again (and re-attaches) rather than ending the attachment."""
        self._attachments = [a for a in self._attachments if not a.closed]
        attachment = Attachment(self._stub, runtime_id, reregister)
        self._attachments.append(attachment)
        return attachment

    async def set_drain(self, runtime_id: str, mode: DrainMode | str) -> None:
        """mode: a `DrainMode`, or its text ("none", "handoff" or "shutdown")."""
        try:
            value = DRAIN_TO_PB[DrainMode(mode)]
        except ValueError:
            raise InvalidArgument(
                f"drain mode must be none, handoff or shutdown, got {mode!r}", field="mode"
            ) from None
        request = pb.SetDrainRequest(runtime_id=runtime_id, mode=value)
        await unary(self._stub.SetDrain(request), KernelError)

    async def record_handoff(
        self,
        old_runtime_id: str,
        new_runtime_id: str,
        *,
        loadout_revision: int = 0,
        in_flight: int = 0,
        session_id: str = "",
        epoch: int = 0,
    ) -> int:
        request = pb.RecordHandoffRequest(
            old_runtime_id=old_runtime_id,
            new_runtime_id=new_runtime_id,
            loadout_revision=loadout_revision,
            in_flight=in_flight,
            session_id=session_id,
            epoch=epoch,
        )
        response = await unary(self._stub.RecordHandoff(request), KernelError)
        return response.handoff_id

    async def list_runtimes(self) -> list[RuntimeInfo]:
        response = await unary(self._stub.ListRuntimes(pb.ListRuntimesRequest()), KernelError)
        return [runtime_from_pb(r) for r in response.runtimes]

    async def list_handoffs(self, limit: int = 100) -> list[HandoffInfo]:
        """The newest handoffs first."""
        request = pb.ListHandoffsRequest(limit=limit)
        response = await unary(self._stub.ListHandoffs(request), KernelError)
        return [handoff_from_pb(h) for h in response.handoffs]

    # -- leases --
    # Claim, renew, finish and release ride one LeaseStream per client (see
    # kernel.lease_stream_client): a message each, not a call. The unary
    # RPCs stay for other callers, and for a kernel older than LeaseStream
    # (the client falls back to them).

    async def claim(self, runtime_id: str, wait_ms: int = 0) -> Lease | None:
        """A lease on a runnable session, or None if none came within wait_ms."""
        response, _ = await self._claim(runtime_id, wait_ms, with_loadout=False)
        return lease_from_pb(response.lease) if response.HasField("lease") else None

    async def claim_with_loadout(self, runtime_id: str, wait_ms: int = 0) -> Claim | None:
        """`claim`, with the tenant's latest loadout found in the same step
        (no GetLoadout needed); None if nothing came within wait_ms."""
        response, link = await self._claim(runtime_id, wait_ms, with_loadout=True)
        return await self._claim_of(response, link)

    async def next_wake(self) -> Claim:
        """The next wake of a session this client keeps in a sticky window
        (kernel.sticky): its lease is held again, same epoch, and its
        loadout comes as a claim's does. Wakes queue from the first call."""
        self._leases.accept_wakes = True
        while True:
            response, link = await self._leases.wakes.get()
            try:
                claim = await self._claim_of(response, link)
            except KeelError as error:
                # Its loadout could not be read (the kernel's database is
                # away): the lease goes back rather than waiting out its TTL.
                log.warning("wake of %s not taken: %s", response.lease.session_id, error)
                with contextlib.suppress(KeelError):
                    lease = response.lease
                    await self.release(lease.session_id, lease.epoch, lease.runtime_id)
                continue
            if claim is not None:
                return claim

    @property
    def wakes_can_come(self) -> bool:
        """Lease operations use a LeaseStream: a Finish may ask for a window."""
        return self._leases.streaming

    async def _claim_of(self, response: pb.ClaimResponse, link: StreamLink | None) -> Claim | None:
        if not response.HasField("lease"):
            return None
        lease = lease_from_pb(response.lease)
        if not response.HasField("loadout"):
            return Claim(lease, None, response.facts)
        revision = response.loadout.revision
        document = response.loadout.document_json
        if not document:
            # Sent earlier on this stream (kernel.lease_stream_server).
            sent_revision, sent = (link.loadouts if link else {}).get(lease.tenant_id, (-1, ""))
            document = sent if sent_revision == revision else ""
        if not document:
            # Cannot happen with a kernel that keeps the stream's rule; if
            # it does, ask for exactly the revision the claim found.
            return Claim(lease, await self.get_loadout(lease.tenant_id, revision), response.facts)
        loadout = LoadoutRevision(lease.tenant_id, revision, json.loads(document))
        return Claim(lease, loadout, response.facts)

    async def _claim(
        self, runtime_id: str, wait_ms: int, with_loadout: bool
    ) -> tuple[pb.ClaimResponse, StreamLink | None]:
        request = pb.ClaimRequest(runtime_id=runtime_id, wait_ms=wait_ms, with_loadout=with_loadout)
        # A claim unanswered this long is withdrawn (the kernel hands back a
        # lease it took) and raises ServiceUnavailable, as the RPC's deadline.
        timeout = max(wait_ms, 0) / 1000 + _CLAIM_GRACE_S
        answer, link = await self._leases.call(pb.LeaseStreamRequest(claim=request), timeout)
        return answer.claim, link

    async def renew(self, session_id: str, epoch: int, runtime_id: str) -> int:
        """Extends the lease; returns the new expires_at_ms."""
        request = pb.RenewRequest(session_id=session_id, epoch=epoch, runtime_id=runtime_id)
        delay = _RENEW_RETRY_FIRST_S
        for _ in range(_RENEW_ATTEMPTS - 1):
            try:
                return await self._renew_once(request)
            except StreamBroken:
                # A renewal is safe to send twice: sent again on a new stream
                # (maybe to another replica), as the RPC's retry policy does.
                await asyncio.sleep(delay)
                delay *= 2
        return await self._renew_once(request)

    async def _renew_once(self, request: pb.RenewRequest) -> int:
        answer, _ = await self._leases.call(pb.LeaseStreamRequest(renew=request))
        return answer.renew.expires_at_ms

    async def release(
        self, session_id: str, epoch: int, runtime_id: str, handoff: HandoffNote | None = None
    ) -> None:
        """Hands the lease back. With `handoff` (a drain handing the session
        to a successor), the kernel also writes the handoff's audit row."""
        request = pb.ReleaseRequest(session_id=session_id, epoch=epoch, runtime_id=runtime_id)
        if handoff is not None:
            request.handoff.CopyFrom(
                pb.HandoffNote(
                    in_flight=handoff.in_flight, loadout_revision=handoff.loadout_revision
                )
            )
        await self._leases.call(pb.LeaseStreamRequest(release=request))

    async def finish(
        self,
        session_id: str,
        epoch: int,
        runtime_id: str,
        read_through: int,
        *,
        failed: bool = False,
        error: str = "",
        kind: FailureKind = FailureKind.RETRYABLE,
        retry_after_ms: int = 0,
        sticky_ms: int = 0,
    ) -> FinishResult:
        """Settles an attempt; a failed one says its `kind` and the wait
        the provider asked for (`retry_after_ms`, 0 if it did not say). A
        successful one may ask to keep the session for `sticky_ms` (granted
        only over a LeaseStream: `sticky_until_ms` in the result)."""
        request = pb.FinishRequest(
            session_id=session_id,
            epoch=epoch,
            runtime_id=runtime_id,
            read_through=read_through,
            outcome=pb.FINISH_OUTCOME_FAILED if failed else pb.FINISH_OUTCOME_DONE,
            error=error,
            failure=FAILURE_TO_PB[kind] if failed else pb.FAILURE_KIND_UNSPECIFIED,
            retry_after_ms=max(0, retry_after_ms) if failed else 0,
            sticky_ms=0 if failed else max(0, sticky_ms),
        )
        if request.sticky_ms:
            # A wake may come before anyone asks for it: it waits in the queue.
            self._leases.accept_wakes = True
        answer, _ = await self._leases.call(pb.LeaseStreamRequest(finish=request))
        return finish_result_from_pb(answer.finish)

    async def enqueue(
        self,
        session_id: str,
        tenant_id: str,
        input_seq: int = 0,
        unpark: bool = False,
        facts: bytes = b"",
    ) -> None:
        """Says the session owes work. `facts`: what the caller has just
        committed (a packed page), handed on to a runner that keeps the
        session so it need not read them."""
        request = pb.EnqueueRequest(
            session_id=session_id,
            tenant_id=tenant_id,
            input_seq=input_seq,
            unpark=unpark,
            facts=facts,
        )
        await unary(self._stub.Enqueue(request), KernelError)

    async def get_lease(self, session_id: str) -> LeaseInfo:
        request = pb.GetLeaseRequest(session_id=session_id)
        response = await unary(self._stub.GetLease(request), KernelError)
        return lease_info_from_pb(response)
