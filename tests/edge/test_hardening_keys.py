"""Keys stay out of URLs, and guessing keys is slow.

Attacks reproduced:
- a key sent as `?access_token=` on a POST (or any route but the event
  stream) was accepted, so keys ended up in URLs, logs and histories;
- 2,000 wrong keys from one address were all checked against the kernel in
  a few seconds.

The rule for a blocked address (edge/limits.py): no key is checked until
its budget refills (429 with Retry-After, the kernel is not asked), except a
key already accepted from that same address; other addresses are served.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from edge.limits import ClientLimits, FailedKeys, client_address
from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from services.cli.chat_view import SseParser
from services.common.errors import error_info
from tests.support.edge_stack import ADMIN_KEY, DEADLINE_S, Stack
from tests.support.grpc_status import retry_delay_ms
from tests.support.slow_clients import limited_edge

# A right key of the default tenant that is never used before the block.
SECOND_KEY = "second-right-key-abcdefghijklmn"
BURST = 5


def wrong_key(i: int) -> str:
    return f"wrong-key-{i:05d}-abcdefghijklmnop"


def client(url: str, key: str | None, local_address: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    transport = httpx.AsyncHTTPTransport(local_address=local_address) if local_address else None
    return httpx.AsyncClient(
        base_url=url, headers=headers, timeout=httpx.Timeout(DEADLINE_S), transport=transport
    )


async def status_with(url: str, key: str, **headers: str) -> httpx.Response:
    async with client(url, key) as http:
        return await http.get("/v1/sessions", headers=headers)


async def test_a_key_in_the_url_is_refused_except_on_the_event_stream(stack: Stack) -> None:
    session = await stack.new_session()
    in_url = {"access_token": ADMIN_KEY}
    inputs = f"/v1/sessions/{session}/inputs"
    async with client(stack.url, None) as anonymous:
        posted = await anonymous.post(
            inputs, params=in_url, json={"text": "hi", "requestId": "r-url"}
        )
        assert posted.status_code == 401, posted.text
        assert "access_token" in posted.json()["error"]["message"]
        assert posted.headers["www-authenticate"] == "Bearer"
        created = await anonymous.post("/v1/sessions", params=in_url, json={"id": "from-url"})
        assert created.status_code == 401, created.text
        assert (await anonymous.get("/v1/sessions", params=in_url)).status_code == 401
        # Beside a header too: the URL has leaked the key either way.
        both = await stack.http.post(
            inputs, params=in_url, json={"text": "hi", "requestId": "r-both"}
        )
        assert both.status_code == 401, both.text

        # Nothing was committed or created.
        assert [f for f in await stack.facts(session) if f.kind == "input"] == []
        assert (await stack.http.get("/v1/sessions/from-url")).status_code == 404

        # The event stream takes it (EventSource cannot send headers): a page...
        events = f"/v1/sessions/{session}/events"
        page = await anonymous.get(events, params={**in_url, "format": "json"})
        assert page.status_code == 200, page.text
        assert page.json()["facts"][0]["kind"] == "session_created"
        # ...and the SSE stream itself.
        async with anonymous.stream("GET", events, params=in_url) as stream:
            assert stream.status_code == 200
            parser = SseParser()
            async for line in stream.aiter_lines():
                event = parser.feed(line)
                if event is not None and event.id is not None:
                    assert event.event == "session_created"
                    break


async def test_wrong_keys_from_one_address_are_refused_without_asking_the_kernel(
    stack: Stack,
) -> None:
    await stack.cluster.kernel.create_api_key("default", SECOND_KEY)
    limits = ClientLimits(failed_keys_burst=BURST, failed_keys_window_s=600.0)
    async with limited_edge(stack, limits) as edge:
        url = edge.url
        # Used from this address before anyone guesses from it.
        assert (await status_with(url, ADMIN_KEY)).status_code == 200

        statuses = [(await status_with(url, wrong_key(i))).status_code for i in range(BURST)]
        assert statuses == [401] * BURST
        refused = await status_with(url, wrong_key(BURST))
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_failed_keys"
        assert int(refused.headers["retry-after"]) >= 1

        # A key accepted from this address before still works from it...
        assert (await status_with(url, ADMIN_KEY)).status_code == 200
        # ...a right key never seen from here is not checked either, and a
        # forged X-Forwarded-For does not make this another address.
        assert (await status_with(url, SECOND_KEY)).status_code == 429
        spoofed = await status_with(url, SECOND_KEY, **{"X-Forwarded-For": "10.9.8.7"})
        assert spoofed.status_code == 429

        # Another address is served, and has a budget of its own.
        async with client(url, SECOND_KEY, local_address="127.0.0.2") as elsewhere:
            assert (await elsewhere.get("/v1/sessions")).status_code == 200
        async with client(url, wrong_key(99), local_address="127.0.0.2") as guesser:
            assert (await guesser.get("/v1/sessions")).status_code == 401

        # The public gRPC API shares the count: RESOURCE_EXHAUSTED, with a RetryInfo.
        assert edge.grpc_address is not None
        async with grpc.aio.insecure_channel(edge.grpc_address) as channel:
            stub = pb_grpc.SessionServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ListSessions(
                    pb.ListSessionsRequest(),
                    metadata=(("authorization", f"Bearer {wrong_key(BURST + 1)}"),),
                    timeout=DEADLINE_S,
                )
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = error_info(caught.value)
        assert info is not None and info.reason == "FAILED_KEYS_RATE_LIMITED"
        delay = retry_delay_ms(caught.value)
        assert delay is not None and delay >= 1000

        # The kernel is not asked: with it gone, a blocked address still gets
        # its 429 (a key checked now would be a 503).
        await stack.cluster.kernel_server.stop()
        again = await status_with(url, wrong_key(BURST + 2))
        assert again.status_code == 429, again.text


async def test_grpc_failures_count_against_http_from_the_same_address(stack: Stack) -> None:
    limits = ClientLimits(failed_keys_burst=BURST, failed_keys_window_s=600.0)
    async with limited_edge(stack, limits) as edge:
        assert edge.grpc_address is not None
        async with grpc.aio.insecure_channel(edge.grpc_address) as channel:
            stub = pb_grpc.SessionServiceStub(channel)
            for i in range(BURST):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.ListSessions(
                        pb.ListSessionsRequest(),
                        metadata=(("authorization", f"Bearer {wrong_key(i)}"),),
                        timeout=DEADLINE_S,
                    )
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await status_with(edge.url, wrong_key(BURST))).status_code == 429


def test_failed_keys_track_a_bounded_number_of_addresses() -> None:
    failed = FailedKeys(ClientLimits(failed_keys_burst=2, tracked_addresses=100))
    for i in range(1000):
        address = f"10.0.{i // 250}.{i % 250}"
        reserved = failed.reserve(address, "k")
        failed.rejected(address, "k")
        assert reserved
    assert failed.tracked == 100


def test_an_ipv6_host_counts_as_its_whole_slash_64() -> None:
    assert client_address("2001:db8:1:2::1") == client_address("2001:db8:1:2:ffff::9")
    assert client_address("2001:db8:1:2::1") != client_address("2001:db8:1:3::1")
    assert client_address("::ffff:192.0.2.7") == "192.0.2.7"
    assert client_address("192.0.2.7") == "192.0.2.7"


async def test_behind_a_trusted_proxy_the_forwarded_address_counts(stack: Stack) -> None:
    limits = ClientLimits(
        failed_keys_burst=BURST, failed_keys_window_s=600.0, trusted_proxies=("127.0.0.1",)
    )
    async with limited_edge(stack, limits) as edge:
        first = {"X-Forwarded-For": "198.51.100.1"}
        statuses = [
            (await status_with(edge.url, wrong_key(i), **first)).status_code
            for i in range(BURST + 1)
        ]
        assert statuses == [401] * BURST + [429]
        second = {"X-Forwarded-For": "198.51.100.2"}
        assert (await status_with(edge.url, wrong_key(50), **second)).status_code == 401


def test_limits_come_from_the_environment() -> None:
    limits = ClientLimits.from_env(
        {
            "KEEL_EDGE_STREAMS_PER_KEY": "7",
            "KEEL_EDGE_HEADER_TIMEOUT_S": "2.5",
            "KEEL_EDGE_TRUSTED_PROXIES": "10.0.0.1, 10.0.0.2",
        }
    )
    assert limits.streams_per_key == 7 and limits.header_timeout_s == 2.5
    assert limits.trusted_proxies == ("10.0.0.1", "10.0.0.2")
    assert limits.streams_per_tenant == ClientLimits().streams_per_tenant
    with pytest.raises(ValueError, match="KEEL_EDGE_STREAMS_PER_KEY"):
        ClientLimits.from_env({"KEEL_EDGE_STREAMS_PER_KEY": "many"})
    with pytest.raises(ValueError, match="KEEL_EDGE_BODY_TIMEOUT_S"):
        ClientLimits.from_env({"KEEL_EDGE_BODY_TIMEOUT_S": "0"})
