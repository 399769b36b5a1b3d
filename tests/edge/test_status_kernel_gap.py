"""`GET /v1/sessions/{id}` while the kernel cannot be asked: the edge does
not know whether an attempt holds the session (a runner may still be
streaming its answer), so it answers 503 with Retry-After, and GetSession
UNAVAILABLE with a RetryInfo, never `idle`."""

from __future__ import annotations

from keel_client import AsyncKeelClient
from keel_client import Unavailable as ClientUnavailable
from tests.support.edge_stack import ADMIN_KEY, Stack


async def test_a_session_is_not_reported_idle_while_the_kernel_is_away(stack: Stack) -> None:
    session = await stack.new_session()
    posted = await stack.post_input(session, "an answer the kernel must schedule", "gap-1")
    assert posted.status_code == 202, posted.text
    # Asked once with the kernel up: the key is known to the edge from now on.
    before = await stack.http.get(f"/v1/sessions/{session}")
    assert before.status_code == 200 and before.json()["owedInputs"], before.text

    await stack.cluster.kernel_server.stop(grace=0)

    during = await stack.http.get(f"/v1/sessions/{session}")
    assert during.status_code == 503, during.text
    assert int(during.headers["Retry-After"]) >= 1
    assert during.json()["error"]["code"] == "unavailable"
    async with AsyncKeelClient(stack.grpc_address, ADMIN_KEY) as client:
        try:
            shown = await client.get_session(session)
        except ClientUnavailable as refused:
            assert refused.code is not None and refused.code.name == "UNAVAILABLE"
            assert refused.retry_after_s
        else:
            raise AssertionError(f"GetSession answered {shown} with the kernel away")
