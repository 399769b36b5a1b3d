"""What every Keel service shares: settings, errors, telemetry, gRPC serving."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.common.config import Settings
    from services.common.errors import KeelError, error_from_rpc
    from services.common.serving import GrpcService, serve_services

__all__ = ["GrpcService", "KeelError", "Settings", "error_from_rpc", "serve_services"]

# name -> the module that defines it. Nothing is imported until a name is
# first read (PEP 562), so importing one small module of this package does
# not load the whole service; TYPE_CHECKING gives mypy and IDEs the names.
_EXPORTS: dict[str, str] = {
    "Settings": "services.common.config",
    "KeelError": "services.common.errors",
    "error_from_rpc": "services.common.errors",
    "GrpcService": "services.common.serving",
    "serve_services": "services.common.serving",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
