"""The edge gateway: Keel's public HTTP API, resumable SSE, blobs, the web page.

Public surface::

    EdgeServer, run_edge   uvicorn serving the Starlette app (embedded or standalone)
    create_app, Gateway    the app and the operations behind it
    EdgeError …            HTTP errors with a JSON body (edge.errors)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge.app import create_app
    from edge.errors import EdgeError
    from edge.gateway import Gateway
    from edge.server import EdgeServer, run_edge

__all__ = ["EdgeError", "EdgeServer", "Gateway", "create_app", "run_edge"]

# name -> the module that defines it. Nothing is imported until a name is
# first read (PEP 562), so importing one small module of this package does
# not load the whole service; TYPE_CHECKING gives mypy and IDEs the names.
_EXPORTS: dict[str, str] = {
    "create_app": "edge.app",
    "EdgeError": "edge.errors",
    "Gateway": "edge.gateway",
    "EdgeServer": "edge.server",
    "run_edge": "edge.server",
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
