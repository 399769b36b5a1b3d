"""Bad messages for every RPC of the public gRPC API (keel.sessions.v1),
against a real edge on loopback.

hypothesis builds requests with hostile field values (empty, oversized and
non-ASCII ids, negative and huge numbers, JSON that is not JSON or not an
object, unknown sessions next to a real one), and raw bytes that may not
decode as the request at all. Every refusal must be a status a client can
act on with an `ErrorInfo.reason` in its details, never UNKNOWN or INTERNAL
(a bug's answer). Generation is derandomized and bounded, so every run sends
the same calls.

The edge serves on the test's event loop; the driver (tests/support/grpc_fuzz.py)
runs as a process of its own, whose global `random` nothing else touches.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from tests.support.edge_stack import ADMIN_KEY, Stack
from tests.support.grpc_fuzz import SERVICE, error_reason, requests_of

AUTH = (("authorization", f"Bearer {ADMIN_KEY}"),)
REPO = Path(__file__).resolve().parents[2]


async def _run_driver(address: str, real_session: str) -> list[str]:
    driver = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.grpc_fuzz",
        address,
        real_session,
        ADMIN_KEY,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await driver.communicate()
    assert driver.returncode == 0, err.decode(errors="replace")[-4000:]
    problems: list[str] = json.loads(out)
    return problems


def test_every_rpc_is_covered() -> None:
    served = set(pb.DESCRIPTOR.services_by_name["SessionService"].methods_by_name)
    assert served == set(requests_of("s"))


async def test_bad_messages_get_a_reasoned_refusal_on_every_rpc(stack: Stack) -> None:
    real = await stack.new_session("fuzz-real")
    problems = await _run_driver(stack.grpc_address, real)
    assert not problems, "\n".join(sorted(set(problems))[:30])
    # Still serving.
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        reply = await pb_grpc.SessionServiceStub(channel).GetSession(
            pb.GetSessionRequest(session_id=real), metadata=AUTH
        )
    assert reply.session_id == real


@pytest.mark.parametrize("payload", [b"\x0a\x02\xff\xfe", b"\x0a\x05ab", b"\xff"])
async def test_undecodable_bytes_are_invalid_argument(stack: Stack, payload: bytes) -> None:
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        call: Callable[..., Any] = channel.unary_unary(SERVICE + "GetSession", None, None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(payload, metadata=AUTH)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert error_reason(refused.value) == "MALFORMED_REQUEST"


async def test_calls_without_a_key_are_unauthenticated(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListSessions(pb.ListSessionsRequest())
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_reason(refused.value) == "UNAUTHENTICATED"
