"""gRPC calls carry OpenTelemetry spans only when an exporter takes them:
with the default `KEEL_OTEL_EXPORTER=none` the instrumentation would cost
every internal call without anyone ever seeing a span."""

from __future__ import annotations

import pytest

from services.common.config import Settings
from services.common.serving import open_channel


@pytest.mark.parametrize(("exporter", "traced"), [("none", False), ("console", True)])
async def test_channels_are_instrumented_only_when_spans_go_somewhere(
    exporter: str, traced: bool
) -> None:
    settings = Settings.from_env({"KEEL_OTEL_EXPORTER": exporter})
    assert settings.tracing is traced
    channel = open_channel("127.0.0.1:1", settings)
    try:
        assert bool(channel._unary_unary_interceptors) is traced  # type: ignore[attr-defined]
    finally:
        await channel.close(None)


KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


@pytest.mark.parametrize("exporter", ["none", "console"])
async def test_the_internal_token_is_sent_on_every_kind_of_call(exporter: str) -> None:
    """grpc.aio files each interceptor under one call kind only: a single
    class for several kinds would leave streaming calls without the token."""
    settings = Settings.from_env(
        {"KEEL_INTERNAL_TOKEN": "s3cret-internal-token", "KEEL_OTEL_EXPORTER": exporter}
    )
    channel = open_channel("127.0.0.1:1", settings)
    try:
        for kind in KINDS:
            interceptors = getattr(channel, f"_{kind}_interceptors")
            carriers = [i for i in interceptors if type(i).__module__.endswith("internal_auth")]
            assert len(carriers) == 1, (kind, interceptors)
            assert carriers[0]._token == "s3cret-internal-token"
    finally:
        await channel.close(None)


async def test_no_token_no_token_interceptor() -> None:
    channel = open_channel("127.0.0.1:1", Settings())
    try:
        for kind in KINDS:
            assert getattr(channel, f"_{kind}_interceptors") == [], kind
    finally:
        await channel.close(None)
