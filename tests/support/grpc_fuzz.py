"""The hypothesis driver of the public gRPC API's fuzz test, run as its own
process: `python -m tests.support.grpc_fuzz ADDRESS REAL_SESSION KEY` prints
the problems found as a JSON list.

Hypothesis checks that nothing touches the global `random` while it draws an
example. A stack serving on the test's event loop does exactly that from
other threads (psycopg_pool's connection jitter, eventsourcing's retries,
OpenTelemetry's span ids once a provider is set), so a driver in the same
process failed now and then in a full run. A process of its own shares no
global state with the stack it calls.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.sessions.v1 import sessions_pb2 as pb

# Per RPC and kind of request; KEEL_FUZZ_EXAMPLES raises it for a longer hunt.
EXAMPLES_PER_RPC = int(os.environ.get("KEEL_FUZZ_EXAMPLES", "40"))
CALL_TIMEOUT_S = 10.0
SERVICE = "/keel.sessions.v1.SessionService/"
# Refusals a client can act on; UNKNOWN and INTERNAL are bugs, UNAVAILABLE
# would mean a healthy stack fell over.
ACCEPTABLE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_DETAILS_KEY = "grpc-status-details-bin"
INT64 = st.one_of(
    st.sampled_from([0, -1, 1, 2, (1 << 63) - 1, -(1 << 63)]),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
)
INT32 = st.integers(min_value=-(1 << 31), max_value=(1 << 31) - 1)
TEXT = st.one_of(
    st.sampled_from(["", " ", "a" * 129, "a" * 5000, "nl\n", "../x", "a:b", "\x00", "é"]),
    st.text(max_size=40),
)
JSON_TEXT = st.one_of(
    TEXT,
    st.sampled_from(["{", "null", "[]", "1", '"x"', "{}", '{"tools": 5}', '{"a":' * 200]),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=8,
    ).map(json.dumps),
)


def _session_ids(real: str) -> st.SearchStrategy[str]:
    return st.one_of(st.just(real), st.just("no-such-session"), TEXT)


def requests_of(real: str) -> dict[str, st.SearchStrategy[Any]]:
    """A strategy of bad (and some good) requests for each RPC."""
    sid = _session_ids(real)
    return {
        "CreateSession": st.builds(pb.CreateSessionRequest, session_id=TEXT),
        "GetSession": st.builds(pb.GetSessionRequest, session_id=sid),
        "ListSessions": st.builds(pb.ListSessionsRequest, page_size=INT32, page_token=TEXT),
        "SendInput": st.builds(
            pb.SendInputRequest,
            session_id=sid,
            text=TEXT,
            request_id=TEXT,
            blob_ids=st.lists(TEXT, max_size=3),
            multitask=TEXT | st.sampled_from(["enqueue", "reject", "interrupt", "rollback"]),
        ),
        "StreamEvents": st.builds(pb.StreamEventsRequest, session_id=sid, after_seq=INT64),
        "Cancel": st.builds(pb.CancelRequest, session_id=sid),
        "Retry": st.builds(pb.RetryRequest, session_id=sid, seq=INT64, request_id=TEXT),
        "SkipInputs": st.builds(pb.SkipInputsRequest, session_id=sid),
        "CreateSchedule": st.builds(
            pb.CreateScheduleRequest,
            session_id=sid,
            text=TEXT,
            cron=TEXT | st.just("*/5 * * * *"),
            timezone=TEXT | st.just("Europe/Berlin"),
            at_ms=INT64,
        ),
        "ListSchedules": st.builds(pb.ListSchedulesRequest, session_id=sid),
        "DeleteSchedule": st.builds(pb.DeleteScheduleRequest, session_id=sid, schedule_id=TEXT),
        "ForkSession": st.builds(
            pb.ForkSessionRequest, session_id=sid, at_seq=INT64, new_session_id=TEXT
        ),
        "EditInput": st.builds(
            pb.EditInputRequest, session_id=sid, seq=INT64, text=TEXT, request_id=TEXT
        ),
        "DecideApproval": st.builds(
            _decision,
            session_id=sid,
            tool_call_id=TEXT,
            approve=st.none() | st.booleans(),
            note=TEXT,
        ),
        "GetContext": st.builds(pb.GetContextRequest, session_id=sid, at_seq=INT64),
        "GetLoadout": st.just(pb.GetLoadoutRequest()),
        "PutLoadout": st.builds(
            pb.PutLoadoutRequest, document_json=JSON_TEXT, expected_revision=INT64
        ),
    }


def _decision(
    session_id: str, tool_call_id: str, approve: bool | None, note: str
) -> pb.DecideApprovalRequest:
    request = pb.DecideApprovalRequest(session_id=session_id, tool_call_id=tool_call_id, note=note)
    if approve is not None:
        request.approve = approve
    return request


def error_reason(error: Any) -> str:
    """The ErrorInfo reason of a failed call ("" when it has none)."""
    for key, value in error.trailing_metadata() or ():
        if key != _DETAILS_KEY:
            continue
        for detail in status_pb2.Status.FromString(value).details:
            info = error_details_pb2.ErrorInfo()
            if detail.Is(info.DESCRIPTOR) and detail.Unpack(info):
                reason: str = info.reason
                return reason
    return ""


def _judge(what: str, error: Any, problems: list[str]) -> None:
    if error is None:
        return
    code = error.code()
    if code not in ACCEPTABLE or not error_reason(error):
        details = error.details()
        problems.append(f"{what}: {code.name} reason={error_reason(error)!r} {details!r:.200}")


def _stream(channel: grpc.Channel, request: bytes | Any, raw: bool) -> grpc.RpcError | None:
    """Opens StreamEvents; an accepted stream (its headers came, no status)
    is cancelled at once, since it would follow the session forever."""
    call: Any = channel.unary_stream(
        SERVICE + "StreamEvents",
        request_serializer=None if raw else pb.StreamEventsRequest.SerializeToString,
        response_deserializer=None,
    )(request, metadata=_auth(), timeout=CALL_TIMEOUT_S)
    call.initial_metadata()
    if not call.done():
        call.cancel()
        return None
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        return error if error.code() != grpc.StatusCode.CANCELLED else None
    return None


def _unary(channel: grpc.Channel, rpc: str, request: Any, raw: bool) -> grpc.RpcError | None:
    serializer = None if raw else request.SerializeToString
    method = channel.unary_unary(
        SERVICE + rpc, request_serializer=serializer, response_deserializer=None
    )
    try:
        method(request, metadata=_auth(), timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        return error
    return None


def _call(channel: grpc.Channel, rpc: str, request: bytes | Any) -> grpc.RpcError | None:
    raw = isinstance(request, bytes)
    if rpc == "StreamEvents":
        return _stream(channel, request, raw)
    return _unary(channel, rpc, request, raw)


def _fuzz(rpc: str, strategy: st.SearchStrategy[Any], address: str, problems: list[str]) -> None:
    with grpc.insecure_channel(address) as channel:

        @settings(
            max_examples=EXAMPLES_PER_RPC,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(request=strategy)
        def run(request: Any) -> None:
            _judge(f"{rpc}({request!r:.200})", _call(channel, rpc, request), problems)

        run()


def _fuzz_all(address: str, real_session: str) -> list[str]:
    problems: list[str] = []
    for rpc, strategy in requests_of(real_session).items():
        _fuzz(rpc, strategy, address, problems)
        # Bytes that may not be this request at all: bad wire types, cut
        # messages, strings that are not UTF-8.
        raw = st.one_of(
            st.sampled_from([b"\xff", b"\x0a\x02\xff\xfe", b"\x0a\x05ab", b"\x08\x80\x80\x80"]),
            st.binary(max_size=64),
        )
        _fuzz(rpc, raw, address, problems)
    return problems


_KEY: list[str] = []


def _auth() -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {_KEY[0]}"),)


def main(argv: list[str]) -> int:
    address, real_session, key = argv
    _KEY.append(key)
    print(json.dumps(_fuzz_all(address, real_session)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
