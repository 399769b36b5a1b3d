"""Uploaded blobs reach the model, over real HTTP with a real runner.

A client uploads an image and a text file with the resumable blob routes,
then sends an input that references both. The scripted model records every
request it gets ($KEEL_RECORD_REQUESTS): the request that answered the input
must carry the image's bytes (base64) and the file's text, and the
compaction service's GetContext must show exactly that request.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent_io.providers.scripted import RECORD_ENV
from compaction.client import CompactionClient
from services.ledger import CommittedFact
from services.runner.server import RunnerServer
from tests.support.blobs import PNG
from tests.support.edge_stack import Stack
from tests.support.http_errors import assert_error
from tests.support.polling import eventually

NOTES = "Shopping list:\n- oat milk\n- rye bread\n"


async def upload(http: httpx.AsyncClient, data: bytes, content_type: str) -> str:
    """Creates a blob and sends it in two chunks, each at its offset."""
    created = await http.post("/v1/blobs", json={"length": len(data), "contentType": content_type})
    assert created.status_code == 201, created.text
    blob_id: str = created.json()["id"]
    half = len(data) // 2
    for offset, chunk in ((0, data[:half]), (half, data[half:])):
        sent = await http.patch(
            f"/v1/blobs/{blob_id}", content=chunk, headers={"Upload-Offset": str(offset)}
        )
        assert sent.status_code == 200, sent.text
    assert (await http.get(f"/v1/blobs/{blob_id}")).json()["complete"] is True
    return blob_id


def recorded(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_an_inputs_blobs_are_shown_to_the_model(
    stack: Stack, runner: RunnerServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = tmp_path / "requests.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(requests))
    image = await upload(stack.http, PNG, "image/png")
    notes = await upload(stack.http, NOTES.encode(), "text/plain; charset=utf-8")
    session = await stack.new_session()
    posted = await stack.http.post(
        f"/v1/sessions/{session}/inputs",
        json={"text": "what is in these?", "requestId": "with-blobs", "blobs": [image, notes]},
    )
    assert posted.status_code == 202, posted.text
    seq = posted.json()["seq"]

    async def answered() -> CommittedFact | None:
        return next(
            (
                f
                for f in await stack.facts(session)
                if f.kind == "assistant" and seq in (f.data.get("inputSeqs") or ())
            ),
            None,
        )

    answer = await eventually(answered, "the input to be answered")
    generation = answer.data["generationId"]
    (request,) = [r for r in recorded(requests) if r["generationId"] == generation]
    assert request["messages"][-1] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is in these?"},
            {"type": "image", "data": base64.b64encode(PNG).decode(), "mimeType": "image/png"},
            {"type": "text", "text": f"Attachment {notes} (text/plain):\n{NOTES}"},
        ],
    }
    assert answer.data["content"][0]["text"] == (
        "You said: what is in these?\nAttachments: 1 image(s), 1 text part(s)."
    )

    # GetContext for the head the answer was built at is that very request.
    head = int(generation.removeprefix("gen-"))
    async with CompactionClient(runner.target, stack.cluster.settings) as client:
        context = await client.get_context(stack.ledger_id(session), head)
    assert list(context.messages) == request["messages"]
    assert context.system_prompt == request["system"]


@pytest.mark.parametrize(
    "blob_id",
    [
        "../../x",
        "..",
        "blob-../../x",
        "blob-0123456789ABCDEF01234567",
        "blob-0123456789abcdef0123456z",
    ],
)
async def test_blob_ids_of_another_shape_are_refused(stack: Stack, blob_id: str) -> None:
    session = await stack.new_session()
    refused = await stack.http.post(
        f"/v1/sessions/{session}/inputs",
        json={"text": "read this", "requestId": "bad-blob", "blobs": [blob_id]},
    )
    # Not an id at all: a bad request, before any lookup. In a path, such a
    # blob is simply not found.
    assert_error(refused, 400)
    assert [f.kind for f in await stack.facts(session)] == ["session_created"]
    if "/" not in blob_id:
        assert_error(await stack.http.get(f"/v1/blobs/{blob_id}"), 404)
        assert_error(
            await stack.http.patch(
                f"/v1/blobs/{blob_id}", content=b"x", headers={"Upload-Offset": "0"}
            ),
            404,
        )
