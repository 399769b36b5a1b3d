"""The kernel's messages and their protobuf form, one codec per kind.

The servicer encodes with these and the client decodes with them, so a
field added to a lease, a runtime or a key is mapped in exactly one place.
"""

from __future__ import annotations

from keel.kernel.v1 import kernel_pb2 as pb
from kernel.domain import DrainMode, FailureKind, FinishResult, Lease, LeaseInfo
from kernel.errors import KernelError
from kernel.registry import HandoffInfo, RuntimeInfo
from kernel.tenancy import ApiKeyInfo, Revocation, TenantInfo
from services.common.errors import KeelError
from services.common.rpc import refusal_as_error

DRAIN_TO_PB: dict[DrainMode, pb.DrainMode.ValueType] = {
    DrainMode.NONE: pb.DRAIN_MODE_NONE,
    DrainMode.HANDOFF: pb.DRAIN_MODE_HANDOFF,
    DrainMode.SHUTDOWN: pb.DRAIN_MODE_SHUTDOWN,
}
DRAIN_FROM_PB = {value: mode for mode, value in DRAIN_TO_PB.items()}
FAILURE_TO_PB: dict[FailureKind, pb.FailureKind.ValueType] = {
    FailureKind.RETRYABLE: pb.FAILURE_KIND_RETRYABLE,
    FailureKind.PERMANENT: pb.FAILURE_KIND_PERMANENT,
    FailureKind.RATE_LIMITED: pb.FAILURE_KIND_RATE_LIMITED,
}
# Unspecified (a caller that predates the field) means retryable.
FAILURE_FROM_PB = {value: kind for kind, value in FAILURE_TO_PB.items()}


def lease_to_pb(lease: Lease) -> pb.Lease:
    return pb.Lease(
        session_id=lease.session_id,
        tenant_id=lease.tenant_id,
        runtime_id=lease.runtime_id,
        attempt_id=lease.attempt_id,
        epoch=lease.epoch,
        expires_at_ms=lease.expires_at_ms,
        reclaimed=lease.reclaimed,
        failures=lease.failures,
        rate_limits=lease.rate_limits,
    )


def lease_from_pb(message: pb.Lease) -> Lease:
    return Lease(
        session_id=message.session_id,
        tenant_id=message.tenant_id,
        runtime_id=message.runtime_id,
        attempt_id=message.attempt_id,
        epoch=message.epoch,
        expires_at_ms=message.expires_at_ms,
        reclaimed=message.reclaimed,
        failures=message.failures,
        rate_limits=message.rate_limits,
    )


def lease_info_to_pb(info: LeaseInfo) -> pb.GetLeaseResponse:
    response = pb.GetLeaseResponse(
        queued=info.queued,
        parked=info.parked,
        failures=info.failures,
        rate_limits=info.rate_limits,
        not_before_ms=info.not_before_ms,
        last_error=info.last_error,
    )
    if info.lease is not None:
        response.lease.CopyFrom(lease_to_pb(info.lease))
    return response


def lease_info_from_pb(message: pb.GetLeaseResponse) -> LeaseInfo:
    return LeaseInfo(
        lease=lease_from_pb(message.lease) if message.HasField("lease") else None,
        queued=message.queued,
        parked=message.parked,
        failures=message.failures,
        rate_limits=message.rate_limits,
        not_before_ms=message.not_before_ms,
        last_error=message.last_error,
    )


def finish_result_to_pb(result: FinishResult) -> pb.FinishResponse:
    return pb.FinishResponse(
        requeued=result.requeued,
        parked=result.parked,
        not_before_ms=result.not_before_ms,
        parked_reason=result.parked_reason,
        sticky_until_ms=result.sticky_until_ms,
        continued=result.continued,
    )


def finish_result_from_pb(message: pb.FinishResponse) -> FinishResult:
    return FinishResult(
        requeued=message.requeued,
        parked=message.parked,
        not_before_ms=message.not_before_ms,
        parked_reason=message.parked_reason,
        sticky_until_ms=message.sticky_until_ms,
        continued=message.continued,
    )


def runtime_to_pb(runtime: RuntimeInfo) -> pb.Runtime:
    return pb.Runtime(
        runtime_id=runtime.runtime_id,
        address=runtime.address,
        host=runtime.host,
        pid=runtime.pid,
        loadout_revision=runtime.loadout_revision,
        version=runtime.version,
        role=runtime.role,
        drain_mode=DRAIN_TO_PB.get(DrainMode(runtime.drain_mode), pb.DRAIN_MODE_UNSPECIFIED),
        attached=runtime.attached,
        session_ids=list(runtime.session_ids),
        started_at_ms=runtime.started_at_ms,
        session_tenant_ids=list(runtime.session_tenant_ids),
        seen_at_ms=runtime.seen_at_ms,
        attached_here=runtime.attached_here,
    )


def runtime_from_pb(message: pb.Runtime) -> RuntimeInfo:
    return RuntimeInfo(
        runtime_id=message.runtime_id,
        address=message.address,
        host=message.host,
        pid=message.pid,
        loadout_revision=message.loadout_revision,
        version=message.version,
        role=message.role,
        drain_mode=DRAIN_FROM_PB.get(message.drain_mode, DrainMode.NONE).value,
        attached=message.attached,
        session_ids=tuple(message.session_ids),
        started_at_ms=message.started_at_ms,
        session_tenant_ids=tuple(message.session_tenant_ids),
        seen_at_ms=message.seen_at_ms,
        attached_here=message.attached_here,
    )


def handoff_to_pb(handoff: HandoffInfo) -> pb.Handoff:
    return pb.Handoff(
        handoff_id=handoff.handoff_id,
        old_runtime_id=handoff.old_runtime_id,
        new_runtime_id=handoff.new_runtime_id,
        loadout_revision=handoff.loadout_revision,
        in_flight=handoff.in_flight,
        session_id=handoff.session_id,
        epoch=handoff.epoch,
        at_ms=handoff.at_ms,
    )


def handoff_from_pb(message: pb.Handoff) -> HandoffInfo:
    return HandoffInfo(
        handoff_id=message.handoff_id,
        old_runtime_id=message.old_runtime_id,
        new_runtime_id=message.new_runtime_id,
        loadout_revision=message.loadout_revision,
        in_flight=message.in_flight,
        session_id=message.session_id,
        epoch=message.epoch,
        at_ms=message.at_ms,
    )


def tenant_to_pb(tenant: TenantInfo) -> pb.Tenant:
    return pb.Tenant(
        tenant_id=tenant.tenant_id, name=tenant.name, created_at_ms=tenant.created_at_ms
    )


def tenant_from_pb(message: pb.Tenant) -> TenantInfo:
    return TenantInfo(message.tenant_id, message.name, message.created_at_ms)


def api_key_to_pb(key: ApiKeyInfo) -> pb.ApiKey:
    return pb.ApiKey(
        key_id=key.key_id,
        tenant_id=key.tenant_id,
        admin=key.admin,
        operator=key.operator,
        created_at_ms=key.created_at_ms,
        revoked_at_ms=key.revoked_at_ms,
    )


def api_key_from_pb(message: pb.ApiKey) -> ApiKeyInfo:
    return ApiKeyInfo(
        key_id=message.key_id,
        tenant_id=message.tenant_id,
        admin=message.admin,
        operator=message.operator,
        created_at_ms=message.created_at_ms,
        revoked_at_ms=message.revoked_at_ms,
    )


def revocation_to_pb(revocation: Revocation) -> pb.WatchRevocationsResponse:
    return pb.WatchRevocationsResponse(
        revocation_id=revocation.revocation_id, key_hash=revocation.key_hash
    )


def revocation_from_pb(message: pb.WatchRevocationsResponse) -> Revocation:
    return Revocation(message.revocation_id, message.key_hash)


def lease_stream_error_to_pb(error: KeelError) -> pb.LeaseStreamError:
    """What the unary RPC's status would say of `error`, as a stream answer."""
    return pb.LeaseStreamError(
        code=error.code.value[0],
        reason=error.reason,
        message=error.message,
        metadata=error.metadata,
    )


def lease_stream_error_from_pb(message: pb.LeaseStreamError) -> KeelError:
    """The exception the unary RPC would have raised for the same refusal."""
    return refusal_as_error(
        message.code, message.reason, message.message, message.metadata, KernelError
    )
