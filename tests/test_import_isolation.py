"""Importing a small module loads only what it needs.

Package `__init__` files re-export lazily (PEP 562), and the values other
parts read (the runner's partials, the ledger's session views, a fact's
JSON) live in modules of their own, so reading a value does not start a
service's worth of imports. Each case runs in a fresh interpreter: this
process has imported everything already.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"

SERVERS = (
    "services.ledger.server",
    "services.ledger.store",
    "kernel.server",
    "compaction.server",
    "services.runner.server",
    "edge.server",
)
PROVIDERS = ("agent_io.providers", "openai", "anthropic", "mcp")
RUNNER_INSIDES = ("services.runner.runtime", "services.runner.attempt", "compaction.service")

# module -> modules (or packages) it must not load.
MUST_NOT_LOAD: dict[str, tuple[str, ...]] = {
    # "Pure functions" over facts: no gRPC, no event store, no model.
    "compaction.transcript": (
        *SERVERS,
        *PROVIDERS,
        *RUNNER_INSIDES,
        "eventsourcing",
        "services.common.serving",
        "services.ledger.client",
    ),
    # The edge's fan-out talks to ledgers and runners as a client only.
    "edge.fanout": (*SERVERS, *PROVIDERS, *RUNNER_INSIDES, "eventsourcing", "edge.app"),
    "services.ledger.client": (*SERVERS, *PROVIDERS, "eventsourcing", "psycopg"),
    "services.runner.client": (*SERVERS, *PROVIDERS, *RUNNER_INSIDES, "eventsourcing"),
    "services.runner.events": ("grpc", "services.runner.hub", *RUNNER_INSIDES),
    "compaction.policy": ("grpc", "agent_io", "services", "compaction.transcript"),
    # The providers' SDKs load on first use of their adapter.
    "agent_io.providers": ("openai", "anthropic", "grpc", "compaction.service", "services.runner"),
}

LAZY_PACKAGES = ("services.common", "services.ledger", "kernel", "services.runner", "edge")


def _loaded_after_import(module: str) -> set[str]:
    script = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [str(PYTHON if PYTHON.exists() else sys.executable), "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(json.loads(result.stdout))


@pytest.mark.parametrize("module", sorted(MUST_NOT_LOAD))
def test_importing_a_module_loads_only_what_it_needs(module: str) -> None:
    loaded = _loaded_after_import(module)
    assert module in loaded
    leaked = sorted(
        name
        for name in loaded
        for unwanted in MUST_NOT_LOAD[module]
        if name == unwanted or name.startswith(unwanted + ".")
    )
    assert not leaked, f"import {module} loads {leaked}"


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_a_lazy_package_exports_every_name_it_lists(package: str) -> None:
    loaded = importlib.import_module(package)
    exports = loaded._EXPORTS
    assert sorted(exports) == sorted(loaded.__all__)
    for name in loaded.__all__:
        value = getattr(loaded, name)
        assert value is getattr(importlib.import_module(exports[name]), name)
    with pytest.raises(AttributeError):
        _ = loaded.no_such_name
