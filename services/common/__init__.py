"""What every Keel service shares: settings, errors, telemetry, gRPC serving."""

from services.common.config import Settings
from services.common.errors import KeelError, error_from_rpc
from services.common.serving import GrpcService, serve_services

__all__ = ["GrpcService", "KeelError", "Settings", "error_from_rpc", "serve_services"]
