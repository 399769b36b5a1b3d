"""What every Keel service shares: settings, errors, telemetry, gRPC serving."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from services.common.config import Settings
    from services.common.errors import KeelError, error_from_rpc
    from services.common.serving import GrpcService, serve_services

__all__ = ["GrpcService", "KeelError", "Settings", "error_from_rpc", "serve_services"]

# name -> the module that defines it, imported when the name is first read
# (services/common/lazy_exports.py).
_EXPORTS: dict[str, str] = {
    "Settings": "services.common.config",
    "KeelError": "services.common.errors",
    "error_from_rpc": "services.common.errors",
    "GrpcService": "services.common.serving",
    "serve_services": "services.common.serving",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
