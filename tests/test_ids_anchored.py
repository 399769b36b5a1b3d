"""Ids are matched whole, and an input either commits and says so or does not
commit.

The attack: a session id `"nl\\n"` passed the edge's and the ledger's checks
(`$` also matches before a trailing newline), so the session was created and
its input committed; the kernel (which matched whole) then refused the
wake-up, the client got a 400 for an input that was in the ledger, and the
runner logged a traceback every pass. The same hole was in request ids,
tenant ids, key ids and blob ids; and a blob id was a path: `"../../fake"`
read a file outside the blob folder. Every id is now refused with a 400
before anything is committed or read.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from edge.auth import Caller
from edge.errors import BadRequest
from edge.gateway import EdgeConfig, Gateway
from edge.server import EdgeServer
from kernel.domain import check_id as kernel_check_id
from kernel.errors import InvalidArgument, InvalidLoadout
from kernel.loadout import validate_loadout
from services.blobs import check_blob_id, is_blob_id
from services.common.config import Settings
from services.ledger.errors import InvalidId
from services.ledger.facts import check_id as ledger_check_id
from tests.edge.conftest import stack as stack
from tests.support.cluster import Cluster, start_cluster, stop_cluster
from tests.support.edge_stack import ADMIN_KEY, Stack
from tests.support.front_doors import GrpcDoor, Refused

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("edge", "kernel", "services", "compaction", "keel_client")
BLOB = "blob-0123456789abcdef01234567"
PLANTED = "planted-outside-the-blob-folder-5c1e"

# -- every checker matches whole --


def test_no_id_pattern_in_the_code_base_ends_with_dollar() -> None:
    """A `$` at the end of a pattern accepts a trailing newline: patterns are
    matched with fullmatch (or end in \\Z) instead. Patterns that parse text
    line by line (re.MULTILINE) mean "end of line" by it and are left alone."""
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "re"
                    and node.func.attr in ("compile", "match", "fullmatch", "search")
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and re.search(r"(?<!\\)\$\)*$", node.args[0].value)
                    # Line-by-line text parsing, where `$` means end of line.
                    and "MULTILINE" not in ast.unparse(node)
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def _caller() -> Caller:
    return Caller(tenant_id="default", admin=True)


@pytest.mark.parametrize("good", ["nl", "s-1", "a.b_c"])
def test_every_id_checker_refuses_a_trailing_newline(good: str) -> None:
    for suffix in ("\n", "\r\n", "\x00"):
        bad = good + suffix
        with pytest.raises(InvalidId):
            ledger_check_id(bad, "session_id")
        with pytest.raises(InvalidArgument):
            kernel_check_id(bad, "session_id")
        with pytest.raises(BadRequest):
            Gateway.ledger_session_id(_caller(), bad)
    assert ledger_check_id(good, "id") == kernel_check_id(good, "id") == good


def test_blob_ids_are_only_the_stores_shape() -> None:
    assert is_blob_id(BLOB) and check_blob_id(BLOB) == BLOB
    for bad in (BLOB + "\n", "../../fake", "../fake", f"{BLOB}/../x", "blob-" + "A" * 24):
        assert not is_blob_id(bad)


def test_loadout_names_refuse_a_trailing_newline() -> None:
    for document, field in (
        (
            {"model": {"provider": "openai", "name": "m", "apiKeyEnv": "OPENAI_API_KEY\n"}},
            "model.apiKeyEnv",
        ),
        ({"tools": [{"source": "builtin", "names": ["clock\n"]}]}, "tools[0].names[0]"),
    ):
        with pytest.raises(InvalidLoadout) as caught:
            validate_loadout(json.loads(json.dumps(document)))
        assert caught.value.metadata["field"] == field


# -- over HTTP and gRPC: refused, and nothing committed --


async def _ledger_ids(stack: Stack) -> list[str]:
    page = await stack.cluster.ledger.list_sessions("", 1000)
    return [summary.session_id for summary in page.sessions]


async def test_a_session_id_with_a_newline_is_refused_and_nothing_is_committed(
    stack: Stack,
) -> None:
    http = stack.http
    # Created here only so a refused "nl\n" could not quietly write to it.
    assert (await http.post("/v1/sessions", json={"id": "nl"})).status_code == 201
    for bad in ("nl\n", "nl\r\n", "\nnl"):
        created = await http.post("/v1/sessions", json={"id": bad})
        assert created.status_code == 400, (bad, created.text)
    for path in ("nl%0A", "nl%0D%0A", "nl%00"):
        posted = await http.post(f"/v1/sessions/{path}/inputs", json={"text": "hello"})
        assert posted.status_code == 400, (path, posted.text)
        assert (await http.get(f"/v1/sessions/{path}")).status_code == 400
    assert (await http.get("/v1/sessions", params={"after": "nl\n"})).status_code == 400
    # Nothing reached the ledger or the kernel: only "nl", with no input.
    assert [i for i in await _ledger_ids(stack) if "nl" in i] == ["default:nl"]
    assert [f.kind for f in await stack.facts("nl")] == ["session_created"]
    assert not (await stack.cluster.kernel.get_lease("default:nl")).queued

    door = GrpcDoor(stack.grpc_address, ADMIN_KEY)
    try:
        with pytest.raises(Refused) as refused:
            await door.create_session("nl\n")
        assert refused.value.outcome == "invalid_argument"
        with pytest.raises(Refused) as refused:
            await door.send_input("nl\n", "hello")
        assert refused.value.outcome == "invalid_argument"
    finally:
        await door.close()
    assert [i for i in await _ledger_ids(stack) if "nl" in i] == ["default:nl"]


async def test_request_tenant_key_and_blob_ids_with_a_newline_are_refused(stack: Stack) -> None:
    http = stack.http
    session = await stack.new_session("ids")
    inputs = f"/v1/sessions/{session}/inputs"
    for body in (
        {"text": "x", "requestId": "r1\n"},
        {"text": "x", "blobs": [BLOB + "\n"]},
        {"text": "x", "blobs": ["../../fake"]},
    ):
        posted = await http.post(inputs, json=body)
        assert posted.status_code == 400, (body, posted.text)
    assert [f.kind for f in await stack.facts(session)] == ["session_created"]

    tenant = await http.post("/v1/tenants", json={"id": "acme\n"})
    assert tenant.status_code == 400, tenant.text
    listed = (await http.get("/v1/tenants")).json()["tenants"]
    assert not [t for t in listed if t["id"].startswith("acme")]
    key = await http.post("/v1/keys", json={"tenant": "default\n"})
    assert key.status_code == 400, key.text

    made = (await http.post("/v1/keys", json={})).json()
    revoked = await http.delete(f"/v1/keys/{made['id']}%0A")
    assert revoked.status_code == 400, revoked.text
    still = [k for k in (await http.get("/v1/keys")).json()["keys"] if k["id"] == made["id"]]
    assert still[0]["revokedAtMs"] is None


async def test_an_input_committed_but_not_woken_says_it_was_committed(stack: Stack) -> None:
    session = await stack.new_session("says-so")
    # The kernel goes away after the edge knows the caller's key: the ledger
    # commits the input, the wake-up fails.
    await stack.cluster.kernel_server.stop()
    posted = await stack.post_input(session, "hello", "r-1")
    [fact] = [f for f in await stack.facts(session) if f.kind == "input"]
    assert posted.status_code == 503, posted.text
    message = posted.json()["error"]["message"]
    assert f"committed as seq {fact.seq}" in message and "'r-1'" in message, message


# -- a blob id is never a path (the disk store, beside a planted file) --


@pytest.fixture
async def disk_edge(sqlite_settings: Settings) -> AsyncIterator[tuple[Cluster, httpx.AsyncClient]]:
    cluster = await start_cluster(sqlite_settings)
    await cluster.kernel.create_api_key("default", ADMIN_KEY, admin=True)
    edge = await EdgeServer(
        cluster.settings, EdgeConfig(cluster.ledger_server.target, cluster.kernel_server.target)
    ).start()
    try:
        async with httpx.AsyncClient(
            base_url=edge.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        ) as http:
            yield cluster, http
    finally:
        await edge.stop()
        await stop_cluster(cluster)


def _plant(data_dir: Path, name: str) -> Iterator[Path]:
    """A complete blob of tenant "default", as the disk store writes one, but
    outside its folder: what `../<name>` would have reached."""
    info = {
        "id": name,
        "tenant_id": "default",
        "length": len(PLANTED),
        "offset": len(PLANTED),
        "content_type": "text/plain",
        "sha256": "0" * 64,
    }
    for folder in (data_dir, data_dir.parent):
        (folder / f"{name}.json").write_text(json.dumps(info))
        (folder / f"{name}.bin").write_text(PLANTED)
        yield folder / f"{name}.bin"


async def test_a_path_as_a_blob_id_is_refused_and_nothing_is_read(
    disk_edge: tuple[Cluster, httpx.AsyncClient], sqlite_settings: Settings
) -> None:
    cluster, http = disk_edge
    blobs_dir = Path(sqlite_settings.data_dir) / "blobs"
    assert blobs_dir.is_dir()
    planted = list(_plant(Path(sqlite_settings.data_dir), "fake"))
    assert (await http.post("/v1/sessions", json={"id": "paths"})).status_code == 201
    answers: list[httpx.Response] = []
    for blob_id in ("../fake", "../../fake", f"{BLOB}/../../fake", "/" + str(planted[0])[:-4]):
        answer = await http.post(
            "/v1/sessions/paths/inputs", json={"text": "read it", "blobs": [blob_id]}
        )
        assert answer.status_code == 400, (blob_id, answer.text)
        answers.append(answer)
    for path in ("..%2Ffake", "..%2F..%2Ffake"):
        for url in (f"/v1/blobs/{path}", f"/v1/blobs/{path}/content"):
            answer = await http.get(url)
            assert answer.status_code in (400, 404), (url, answer.text)
            answers.append(answer)
    # Nothing about the planted file came back, and nothing was committed.
    for answer in answers:
        assert PLANTED not in answer.text and "sha256" not in answer.text
    facts = await cluster.facts("default:paths")
    assert [f.kind for f in facts] == ["session_created"]
    assert all(path.read_text() == PLANTED for path in planted)
