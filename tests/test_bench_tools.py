"""`keel bench tools` still measures every kind of source through the
registry, at a size a test can afford (its times are reported by the
benchmark, never asserted)."""

from __future__ import annotations

import pytest

from bench.tools import measure

pytestmark = pytest.mark.slow


def test_the_tools_benchmark_calls_every_kind_of_source() -> None:
    result = measure(calls=5, warmup=1)
    for source in ("builtin", "mcp_stdio", "mcp_stdio_sdk_server", "mcp_http", "grpc"):
        figures = result[source]
        assert figures["calls"] == 5, source
        for figure in ("overhead_p50_ms", "overhead_p99_ms", "overhead_max_ms"):
            assert isinstance(figures[figure], float) and figures[figure] >= 0, (source, figure)
    assert result["targets"]["overhead_p50_ms"] == 2.0
    assert isinstance(result["met"], bool)
