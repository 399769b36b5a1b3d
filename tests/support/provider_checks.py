"""What the provider adapters' tests ask of any adapter: its answer to a
request, the error it raises for a refused one, and how it reads the rate
limit and the wait a fault asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agent_io.providers import Completed, ModelRequest, Provider, ProviderError, StreamEvent
from tests.support.fault_provider import Fault, FaultyProvider
from tests.support.wire_servers import WireServer, error_reply


def hello(**overrides: Any) -> ModelRequest:
    """A one-message conversation; `overrides` set the request's other fields."""
    return ModelRequest(
        system="Be brief.", messages=({"role": "user", "content": "Hi"},), **overrides
    )


async def collect(provider: Provider, request: ModelRequest) -> tuple[list[StreamEvent], Completed]:
    """The events streamed, and the one `Completed` that must end them."""
    events = [event async for event in provider.stream(request)]
    last = events[-1]
    assert isinstance(last, Completed)
    assert not any(isinstance(event, Completed) for event in events[:-1])
    return events[:-1], last


async def refused(
    server: WireServer, provider: Provider, status: int, body: dict[str, Any]
) -> ProviderError:
    """The error `provider` raises when `server` answers `status` with `body`,
    after one request: the SDK must not retry on its own."""
    server.queue(error_reply(status, body))
    with pytest.raises(ProviderError) as caught:
        await collect(provider, hello())
    assert caught.value.status == status
    assert len(server.received) == 1  # the SDK did not retry on its own
    return caught.value


async def fault_read(
    path: str, adapter: Callable[[str], Provider], fault: Fault
) -> tuple[bool, bool, int | None]:
    """(retryable, rate_limited, retry_after_ms) of the error that the adapter
    `adapter(url)` makes raises for `fault`, served once at `path`: the SDK
    must not wait and retry on its own."""
    async with FaultyProvider(path, faults=[fault]) as faulty:
        provider = adapter(faulty.url)
        try:
            with pytest.raises(ProviderError) as caught:
                await collect(provider, hello())
        finally:
            await provider.aclose()
    assert faulty.requests == 1  # the SDK did not wait and retry on its own
    error = caught.value
    return error.retryable, error.rate_limited, error.retry_after_ms
