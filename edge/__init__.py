"""The edge gateway: Keel's public HTTP API, resumable SSE, blobs, the web page.

Public surface::

    EdgeServer, run_edge   uvicorn serving the Starlette app (embedded or standalone)
    create_app, Gateway    the app and the operations behind it
    EdgeError …            HTTP errors with a JSON body (edge.errors)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from edge.app import create_app
    from edge.errors import EdgeError
    from edge.gateway import Gateway
    from edge.server import EdgeServer, run_edge

__all__ = ["EdgeError", "EdgeServer", "Gateway", "create_app", "run_edge"]

# name -> the module that defines it, imported when the name is first read
# (services/common/lazy_exports.py).
_EXPORTS: dict[str, str] = {
    "create_app": "edge.app",
    "EdgeError": "edge.errors",
    "Gateway": "edge.gateway",
    "EdgeServer": "edge.server",
    "run_edge": "edge.server",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
