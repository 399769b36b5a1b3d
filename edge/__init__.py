"""The edge gateway: Keel's public HTTP API, resumable SSE, blobs, the web page.

Public surface::

    EdgeServer, run_edge   uvicorn serving the Starlette app (embedded or standalone)
    create_app, Gateway    the app and the operations behind it
    EdgeError …            HTTP errors with a JSON body (edge.errors)
"""

from edge.app import create_app
from edge.errors import EdgeError
from edge.gateway import Gateway
from edge.server import EdgeServer, run_edge

__all__ = ["EdgeError", "EdgeServer", "Gateway", "create_app", "run_edge"]
