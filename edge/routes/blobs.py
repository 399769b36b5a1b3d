"""Blobs: resumable uploads by offset, and downloads of complete ones.

The store (services.blobs) is blocking I/O, so every call runs in a thread;
its refusals are `KeelError`s the app's handler maps to 4xx. A tenant's
quota is checked by the store when a blob is created, on its declared
length, so an upload past the quota is refused before any byte is sent.
"""

from __future__ import annotations

import asyncio
import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edge.auth import Caller
from edge.bodies import CreateBlobBody
from edge.errors import BadRequest, Conflict, PayloadTooLarge
from edge.http import api_route, gateway_of, is_count, read_limited, typed_body
from services.blobs import BlobQuotaExceeded

MAX_CHUNK_BYTES = 8 << 20
# The content type is sent back as a header on download: printable ASCII in
# the `type/subtype; params` shape only, so it can never split a header.
_CONTENT_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+\-]+/[A-Za-z0-9!#$&^_.+\-]+(;[ -~]*)?")
MAX_CONTENT_TYPE_CHARS = 255


class BlobQuotaFull(PayloadTooLarge):
    """The tenant's blobs would pass its quota (count or declared bytes)."""

    code = "blob_quota_exceeded"
    reason = "BLOB_QUOTA_EXCEEDED"


async def create_blob(request: Request, caller: Caller) -> Response:
    body = await typed_body(request, CreateBlobBody)
    length, content_type = body.length, body.content_type
    if len(content_type) > MAX_CONTENT_TYPE_CHARS or not _CONTENT_TYPE.fullmatch(content_type):
        raise BadRequest(
            f"contentType must be a media type such as image/png (type/subtype, optional "
            f"parameters, printable ASCII, at most {MAX_CONTENT_TYPE_CHARS} characters)",
            field="contentType",
        )
    store = gateway_of(request).blobs
    try:
        info = await asyncio.to_thread(store.create, caller.tenant_id, length, content_type)
    except BlobQuotaExceeded as error:
        full = BlobQuotaFull(f"blob quota exceeded: {error.message}")
        full.metadata.update(error.metadata)
        raise full from None
    return JSONResponse(info.to_json(), status_code=201, headers={"Upload-Offset": "0"})


async def blob_offset(request: Request, caller: Caller) -> Response:
    store = gateway_of(request).blobs
    info = await asyncio.to_thread(store.get, caller.tenant_id, request.path_params["id"])
    headers = {"Upload-Offset": str(info.offset), "Upload-Length": str(info.length)}
    if request.method == "HEAD":
        return Response(status_code=200, headers=headers)
    return JSONResponse(info.to_json(), headers=headers)


async def append_blob(request: Request, caller: Caller) -> Response:
    raw_offset = request.headers.get("upload-offset", "")
    if not is_count(raw_offset):
        raise BadRequest("Upload-Offset header (non-negative integer) is required")
    chunk = await read_limited(request, MAX_CHUNK_BYTES)
    store = gateway_of(request).blobs
    info = await asyncio.to_thread(
        store.append, caller.tenant_id, request.path_params["id"], int(raw_offset), chunk
    )
    return JSONResponse(info.to_json(), headers={"Upload-Offset": str(info.offset)})


async def blob_content(request: Request, caller: Caller) -> Response:
    store = gateway_of(request).blobs
    blob_id = request.path_params["id"]
    info = await asyncio.to_thread(store.get, caller.tenant_id, blob_id)
    if not info.complete:
        raise Conflict(f"blob {info.id} is not completely uploaded (offset {info.offset})")
    data = await asyncio.to_thread(store.read, caller.tenant_id, blob_id)
    return Response(
        data,
        headers={
            # The type the client declared, as it declared it (no charset added).
            "Content-Type": info.content_type,
            # Uploaded bytes are the client's, not the edge's: a browser must
            # neither sniff them into HTML nor run them on the page's origin.
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "sandbox",
            "Content-Disposition": "attachment",
        },
    )


routes: list[Route] = [
    api_route("/v1/blobs", create_blob, ["POST"]),
    api_route("/v1/blobs/{id}", blob_offset, ["GET", "HEAD"]),
    api_route("/v1/blobs/{id}", append_blob, ["PATCH"]),
    api_route("/v1/blobs/{id}/content", blob_content, ["GET"]),
]
