"""Editing a loadout never stores an accident, and what was read can be written.

Reproduced: `PUT /v1/loadout {}`, `keel loadout set` of an empty file and
`keel loadout edit` with an emptied buffer each stored an empty revision
(the prompt, the tools and the model silently reset); `PUT` refused the very
body `GET /v1/loadout` answers (`{revision, document}`); `keel loadout set`
of the current document stored a new revision where `edit` said "no change".

Over real HTTP and gRPC against a real edge, and the CLI as a real process
pointed at it (KEEL_URL, KEEL_API_KEY).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from keel.sessions.v1 import sessions_pb2 as pb
from keel.sessions.v1 import sessions_pb2_grpc as pb_grpc
from tests.support.edge_stack import ADMIN_KEY, DEADLINE_S, Stack
from tests.support.keel_up import keel_cli

DOCUMENT: dict[str, Any] = {
    "systemPrompt": "You answer in haiku.",
    "model": {"provider": "scripted", "name": "scripted-1"},
    "tools": [{"source": "builtin", "names": ["clock"]}],
}


async def _stored(stack: Stack) -> dict[str, Any]:
    response = await stack.http.get("/v1/loadout")
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_an_empty_document_is_refused_and_nothing_stored(stack: Stack) -> None:
    http = stack.http
    assert (await http.put("/v1/loadout", json=DOCUMENT)).status_code == 200
    before = await _stored(stack)
    for body in (b"{}", b"", b" \n", b'{"revision": 1, "document": {}}', b"null"):
        response = await http.put(
            "/v1/loadout", content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_loadout", error
        assert "empty" in error["message"], error
    # The gRPC door, which shares the operation.
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        stub = pb_grpc.SessionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.PutLoadout(
                pb.PutLoadoutRequest(document_json="{}"),
                metadata=[("authorization", f"Bearer {ADMIN_KEY}")],
                timeout=DEADLINE_S,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "empty" in (refused.value.details() or "")
    assert await _stored(stack) == before


async def test_what_get_answered_is_put_back_with_its_revision_as_if_match(
    stack: Stack,
) -> None:
    http = stack.http
    assert (await http.put("/v1/loadout", json=DOCUMENT)).status_code == 200
    read = await _stored(stack)
    edited = {**read, "document": {**read["document"], "systemPrompt": "Edited."}}
    stored = await http.put("/v1/loadout", json=edited)
    assert stored.status_code == 200, stored.text
    assert stored.json()["revision"] == read["revision"] + 1
    after = await _stored(stack)
    assert after == {"revision": read["revision"] + 1, "document": edited["document"]}
    # The same read-modify-write again: its revision is stale now.
    stale = await http.put("/v1/loadout", json=edited)
    assert stale.status_code == 412, stale.text
    # If-Match and the body's revision must agree.
    current = await _stored(stack)
    both = await http.put("/v1/loadout", json=current, headers={"If-Match": '"1"'})
    assert both.status_code == 400 and "If-Match" in both.json()["error"]["message"]
    assert await _stored(stack) == current


async def test_null_unsets_a_field(stack: Stack) -> None:
    document = {**DOCUMENT, "systemPrompt": None}
    stored = await stack.http.put("/v1/loadout", json=document)
    assert stored.status_code == 200, stored.text
    assert (await _stored(stack))["document"] == document
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        reply = await pb_grpc.SessionServiceStub(channel).PutLoadout(
            pb.PutLoadoutRequest(document_json=json.dumps({"systemPrompt": None})),
            metadata=[("authorization", f"Bearer {ADMIN_KEY}")],
            timeout=DEADLINE_S,
        )
    assert reply.revision == stored.json()["revision"] + 1


def _cli_env(stack: Stack, **extra: str) -> dict[str, str]:
    return {"KEEL_URL": stack.url, "KEEL_API_KEY": ADMIN_KEY, **extra}


def _editor(replacement: str) -> str:
    """An $EDITOR that rewrites the file it is given to `replacement`."""
    script = f"import sys, pathlib; pathlib.Path(sys.argv[1]).write_text({replacement!r})"
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}"


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
async def test_the_cli_stores_no_empty_and_no_unchanged_loadout(
    stack: Stack, tmp_path: Path
) -> None:
    assert (await stack.http.put("/v1/loadout", json=DOCUMENT)).status_code == 200
    before = await _stored(stack)
    env = _cli_env(stack)
    files = {}
    for name, text in (
        # Only comments: as empty as an empty file.
        ("empty.yaml", "# nothing yet\n\n"),
        # The current document again (as JSON): nothing to store.
        ("same.json", json.dumps(before["document"])),
    ):
        files[name] = tmp_path / name
        files[name].write_text(text)
    commented = (
        "# I only read it\n" + f"systemPrompt: {before['document']['systemPrompt']}\n"
        "model: {provider: scripted, name: scripted-1}\n"
        "tools: [{source: builtin, names: [clock]}]\n"
    )
    # None of these stores anything, so they run at once.
    empty, same, emptied, unchanged = await asyncio.gather(
        keel_cli("loadout", "set", str(files["empty.yaml"]), env=env),
        keel_cli("loadout", "set", str(files["same.json"]), env=env),
        # An emptied buffer cancels the edit; a comment alone changes nothing.
        keel_cli("loadout", "edit", env={**env, "EDITOR": _editor("")}),
        keel_cli("loadout", "edit", env={**env, "EDITOR": _editor(commented)}),
    )
    assert empty.returncode != 0, empty.stdout
    assert "Traceback" not in empty.stderr
    assert "empty loadout; nothing stored" in empty.stderr, empty.stderr
    assert "no change" in _ok(same)
    assert "edit cancelled" in _ok(emptied)
    assert "no change" in _ok(unchanged)
    assert await _stored(stack) == before
    # A change is stored, by set as by edit; null unsets the prompt.
    changed = tmp_path / "changed.yaml"
    changed.write_text("systemPrompt: null\nmodel: {provider: scripted}\n")
    stored = _ok(await keel_cli("loadout", "set", str(changed), env=env))
    assert f"loadout revision {before['revision'] + 1} stored" in stored
    assert (await _stored(stack))["document"] == {
        "systemPrompt": None,
        "model": {"provider": "scripted"},
    }
