"""The client's error mapping and reconnect schedule, without a server.

Statuses are built by `rich_status`, the function every Keel server sends
its refusals with, and carried by grpc's own `AioRpcError`, as a failed call
delivers them; `error_from_rpc` must turn each into the class of its reason.
"""

from __future__ import annotations

import random

import grpc
import pytest

import keel_client
from keel_client import (
    ClientOptions,
    Conflict,
    DeadlineExceeded,
    IdempotencyConflict,
    InvalidArgument,
    InvalidLoadout,
    KeelClientError,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ReconnectPolicy,
    RevisionMismatch,
    SeqOutOfRange,
    ServerError,
    SessionExists,
    SessionNotFound,
    Unauthenticated,
    Unavailable,
    error_from_rpc,
)
from services.common.errors import rich_status

Code = grpc.StatusCode


def failed_call(
    code: grpc.StatusCode,
    reason: str | None,
    message: str = "refused",
    metadata: dict[str, str] | None = None,
    retry_after_ms: int = 0,
) -> grpc.aio.AioRpcError:
    """A failed call as grpc hands it to a client (reason None: no details)."""
    trailing = grpc.aio.Metadata()
    if reason is not None:
        status = rich_status(code, reason, message, metadata or {}, retry_after_ms)
        trailing = grpc.aio.Metadata(*status.trailing_metadata)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, message, None)


# What the edge sends (edge/errors.py, the services' own reasons it passes
# on) and the class a caller catches.
BY_REASON = [
    (Code.UNAUTHENTICATED, "UNAUTHENTICATED", Unauthenticated),
    (Code.PERMISSION_DENIED, "PERMISSION_DENIED", PermissionDenied),
    (Code.NOT_FOUND, "SESSION_NOT_FOUND", SessionNotFound),
    (Code.NOT_FOUND, "NOT_FOUND", NotFound),
    (Code.ALREADY_EXISTS, "IDEMPOTENCY_CONFLICT", IdempotencyConflict),
    (Code.ALREADY_EXISTS, "SESSION_EXISTS", SessionExists),
    (Code.ALREADY_EXISTS, "CONFLICT", Conflict),
    (Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", InvalidArgument),
    (Code.INVALID_ARGUMENT, "SEQ_OUT_OF_RANGE", SeqOutOfRange),
    (Code.INVALID_ARGUMENT, "INVALID_LOADOUT", InvalidLoadout),
    (Code.INVALID_ARGUMENT, "PAYLOAD_TOO_LARGE", PayloadTooLarge),
    (Code.FAILED_PRECONDITION, "REVISION_MISMATCH", RevisionMismatch),
    (Code.UNAVAILABLE, "UNAVAILABLE", Unavailable),
    (Code.INTERNAL, "INTERNAL", ServerError),
]


@pytest.mark.parametrize(("code", "reason", "expected"), BY_REASON)
def test_each_reason_becomes_its_class(
    code: grpc.StatusCode, reason: str, expected: type[KeelClientError]
) -> None:
    error = error_from_rpc(failed_call(code, reason, "no", {"field": "text", "seq": "4"}))
    assert type(error) is expected
    assert error.reason == reason
    assert error.code == code
    assert error.field == "text"
    assert error.metadata["seq"] == "4"
    assert error.message == "no"


def test_the_reason_decides_even_when_the_code_would_say_otherwise() -> None:
    # The edge reports a too-large payload as INVALID_ARGUMENT; the reason is
    # what a caller branches on.
    error = error_from_rpc(failed_call(Code.INVALID_ARGUMENT, "PAYLOAD_TOO_LARGE"))
    assert isinstance(error, PayloadTooLarge)
    assert not isinstance(error, InvalidArgument)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (Code.NOT_FOUND, NotFound),
        (Code.INVALID_ARGUMENT, InvalidArgument),
        (Code.OUT_OF_RANGE, InvalidArgument),
        (Code.ALREADY_EXISTS, Conflict),
        (Code.FAILED_PRECONDITION, Conflict),
        (Code.UNAUTHENTICATED, Unauthenticated),
        (Code.RESOURCE_EXHAUSTED, PayloadTooLarge),
        (Code.UNAVAILABLE, Unavailable),
        (Code.INTERNAL, ServerError),
        (Code.UNIMPLEMENTED, ServerError),
    ],
)
def test_an_unknown_reason_falls_back_on_the_status_code(
    code: grpc.StatusCode, expected: type[KeelClientError]
) -> None:
    error = error_from_rpc(failed_call(code, "A_REASON_FROM_A_NEWER_SERVER"))
    assert type(error) is expected
    # The server's reason is kept for the caller to see.
    assert error.reason == "A_REASON_FROM_A_NEWER_SERVER"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (Code.UNAVAILABLE, Unavailable),
        (Code.CANCELLED, Unavailable),
        (Code.DEADLINE_EXCEEDED, DeadlineExceeded),
        (Code.INTERNAL, ServerError),
        (Code.UNKNOWN, ServerError),
        (Code.PERMISSION_DENIED, PermissionDenied),
    ],
)
def test_a_status_without_details_maps_by_its_code(
    code: grpc.StatusCode, expected: type[KeelClientError]
) -> None:
    error = error_from_rpc(failed_call(code, None, "Socket closed"))
    assert type(error) is expected
    assert error.reason == code.name
    assert error.field is None
    assert "Socket closed" in str(error)


def test_unavailable_carries_the_servers_retry_delay() -> None:
    error = error_from_rpc(failed_call(Code.UNAVAILABLE, "UNAVAILABLE", retry_after_ms=1500))
    assert isinstance(error, Unavailable)
    assert error.retry_after_s == 1.5
    assert error_from_rpc(failed_call(Code.UNAVAILABLE, None)).retry_after_s is None  # type: ignore[attr-defined]


def test_reasons_of_the_clients_own_making_never_come_from_a_server() -> None:
    for reason in ("RECONNECT_GAVE_UP", "STREAM_OUT_OF_ORDER"):
        error = error_from_rpc(failed_call(Code.INTERNAL, reason))
        assert type(error) is ServerError


def test_a_status_detail_contradicting_the_call_is_not_trusted() -> None:
    status = rich_status(Code.NOT_FOUND, "SESSION_NOT_FOUND", "gone", {})
    call = grpc.aio.AioRpcError(
        Code.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        "upstream connect error",
        None,
    )
    assert type(error_from_rpc(call)) is Unavailable


def test_every_error_class_is_exported_and_drawn_in_the_tree() -> None:
    tree = keel_client._errors.__doc__ or ""

    def subclasses(cls: type[KeelClientError]) -> set[type[KeelClientError]]:
        found = {cls}
        for child in cls.__subclasses__():
            found |= subclasses(child)
        return found

    for cls in subclasses(KeelClientError):
        assert getattr(keel_client, cls.__name__) is cls
        assert cls.__name__ in tree, f"{cls.__name__} is missing from the errors docstring"


def test_backoff_grows_to_its_cap_with_jitter_below_it() -> None:
    policy = ReconnectPolicy(initial_backoff_s=0.1, max_backoff_s=2.0, multiplier=2.0, jitter=0.2)
    rng = random.Random(7)
    for attempt, ceiling in enumerate([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]):
        delays = [policy.backoff_s(attempt, rng) for _ in range(50)]
        assert all(ceiling * 0.8 <= d <= ceiling for d in delays), (attempt, delays)
        assert len(set(delays)) > 1, "jitter spreads the delays"
    assert policy.backoff_s(10_000, rng) <= 2.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_backoff_s": 0},
        {"initial_backoff_s": 3, "max_backoff_s": 2},
        {"multiplier": 0.5},
        {"jitter": 1.0},
        {"give_up_after_s": 0},
    ],
)
def test_a_reconnect_policy_that_makes_no_sense_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ReconnectPolicy(**kwargs)


def test_client_options_are_checked() -> None:
    with pytest.raises(ValueError):
        ClientOptions(timeout_s=0)
    with pytest.raises(ValueError):
        ClientOptions(root_certificates=b"pem")
