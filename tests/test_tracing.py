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
        await channel.close()


async def test_the_internal_token_is_sent_without_tracing() -> None:
    channel = open_channel("127.0.0.1:1", Settings.from_env({"KEEL_INTERNAL_TOKEN": "s3cret"}))
    try:
        interceptors = channel._unary_unary_interceptors  # type: ignore[attr-defined]
        assert [type(i).__name__ for i in interceptors] == ["_TokenClientInterceptor"]
    finally:
        await channel.close()
