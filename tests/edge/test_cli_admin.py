"""`keel loadout|tenants|keys` as real processes against a real `keel up`.

The CLI is given no URL: it finds `keel up` (listening on a port it picked)
through the discovery file in the data dir, as a user's shell would. The
key comes from KEEL_API_KEY.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.keel_up import RunningKeel, keel_cli, keel_up
from tests.support.polling import eventually
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

KEY = "cli-admin-test-key-0123456789"
NO_KEY_LINE = "keel: no API key: pass --key or set KEEL_API_KEY\n"
REVISED_PROMPT = "You are the revised loadout."
REVISED_YAML = f"""\
# the tenant's loadout, as a user writes it
systemPrompt: {REVISED_PROMPT}
model:
  provider: scripted
  name: scripted-1
compaction:
  enabled: true
tools:
  - source: builtin
    names: [clock, counter]
"""


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningKeel]:
    with keel_up(tmp_path_factory.mktemp("cli-admin") / "data", KEY) as up:
        yield up


@pytest.fixture
async def http(running: RunningKeel) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=running.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    ) as client:
        yield client


def _env(running: RunningKeel, key: str = KEY) -> dict[str, str]:
    """Where a user's shell points the CLI: the data dir of `keel up`, a key."""
    return {"KEEL_DATA_DIR": str(running.data_dir), "KEEL_API_KEY": key}


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


async def _facts(http: httpx.AsyncClient, session: str) -> list[dict[str, Any]]:
    page = await http.get(f"/v1/sessions/{session}/events", params={"format": "json"})
    assert page.status_code == 200, page.text
    facts: list[dict[str, Any]] = page.json()["facts"]
    return facts


async def _kind(http: httpx.AsyncClient, session: str, kind: str) -> list[dict[str, Any]]:
    async def found() -> list[dict[str, Any]] | None:
        facts = [f for f in await _facts(http, session) if f["kind"] == kind]
        return facts or None

    return await eventually(found, f"a {kind} fact in {session}")


def _built_at(answer: dict[str, Any]) -> int:
    generation: str = answer["data"]["generationId"]
    return int(generation.removeprefix("gen-"))


async def _context(http: httpx.AsyncClient, session: str, at: int) -> dict[str, Any]:
    response = await http.get(f"/v1/sessions/{session}/context", params={"at": str(at)})
    assert response.status_code == 200, response.text
    context: dict[str, Any] = response.json()
    return context


async def _session_with_input(http: httpx.AsyncClient, text: str) -> str:
    session: str = (await http.post("/v1/sessions", json={})).json()["id"]
    posted = await http.post(f"/v1/sessions/{session}/inputs", json={"text": text})
    assert posted.status_code == 202, posted.text
    return session


async def test_loadout_set_names_the_new_revision_in_the_next_attempt_only(
    running: RunningKeel, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    # An attempt under way before the set: it started on the revision then.
    running_session = await _session_with_input(http, "/slow 8 one two three four five six")
    started = (await _kind(http, running_session, "epoch_started"))[0]
    old_revision = started["data"]["loadoutRevision"]

    file = tmp_path / "loadout.yaml"
    file.write_text(REVISED_YAML)
    result = await keel_cli("loadout", "set", str(file), env=_env(running))
    assert result.returncode == 0, result.stderr
    revision = int(result.stdout.split("loadout revision ")[1].split()[0])
    assert revision > old_revision
    assert not [f for f in await _facts(http, running_session) if f["kind"] == "assistant"], (
        "the slow answer ended before the set: this test saw no attempt under way"
    )

    # The next attempt pins the new revision; the running one keeps its own.
    fresh = await _session_with_input(http, "hello after the set")
    assert (await _kind(http, fresh, "epoch_started"))[0]["data"]["loadoutRevision"] == revision
    fresh_answer = (await _kind(http, fresh, "assistant"))[0]
    old_answer = (await _kind(http, running_session, "assistant"))[0]
    epochs = [f for f in await _facts(http, running_session) if f["kind"] == "epoch_started"]
    assert [e["data"]["loadoutRevision"] for e in epochs] == [old_revision]
    # …and each answer was made with its own revision's prompt (/context at
    # the head its request was built at, which its generation id names).
    fresh_context = await _context(http, fresh, _built_at(fresh_answer))
    assert fresh_context["systemPrompt"] == REVISED_PROMPT
    assert fresh_context["loadoutRevision"] == revision
    old_context = await _context(http, running_session, _built_at(old_answer))
    assert old_context["loadoutRevision"] == old_revision
    assert old_context["systemPrompt"] != REVISED_PROMPT

    # `get` prints what was set: YAML by default, JSON with --json.
    shown = await keel_cli("loadout", "get", env=_env(running))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"# loadout revision {revision}\n")
    assert yaml.safe_load(shown.stdout) == yaml.safe_load(REVISED_YAML)
    as_json = await keel_cli("loadout", "get", "--json", env=_env(running))
    assert json.loads(as_json.stdout) == yaml.safe_load(REVISED_YAML)
    # JSON files are read too, told apart by their content (the same
    # document stores nothing: tests/edge/test_loadout_edits.py).
    json_file = tmp_path / "loadout.txt"
    json_file.write_text(json.dumps({**json.loads(as_json.stdout), "systemPrompt": "As JSON."}))
    again = await keel_cli("loadout", "set", str(json_file), env=_env(running))
    assert again.returncode == 0 and f"revision {revision + 1} " in again.stdout


async def test_an_invalid_loadout_is_refused_with_its_field_named(
    running: RunningKeel, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    before = (await http.get("/v1/loadout")).json()["revision"]
    cases = {
        "model:\n  provider: openia\n  name: gpt\n": "model.provider",
        "systemPromt: a typo\n": "systemPromt",
        "tools:\n  - clock\n  - {source: mcp, name: x, transport: pigeon}\n": "tools[1]",
    }
    for text, field in cases.items():
        file = tmp_path / "bad.yaml"
        file.write_text(text)
        result = await keel_cli("loadout", "set", str(file), env=_env(running))
        line = _one_error_line(result)
        assert result.returncode == 1 and field in line, (field, line)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {provider: scripted\n")
    line = _one_error_line(await keel_cli("loadout", "set", str(broken), env=_env(running)))
    assert "not valid YAML" in line
    missing = await keel_cli("loadout", "set", str(tmp_path / "nope.yaml"), env=_env(running))
    assert "cannot read" in _one_error_line(missing)
    assert (await http.get("/v1/loadout")).json()["revision"] == before


async def test_tenants_and_keys_through_the_cli(
    running: RunningKeel, http: httpx.AsyncClient
) -> None:
    env = _env(running)
    created = await keel_cli("tenants", "create", "acme", "--name", "Acme", env=env)
    assert created.returncode == 0 and "tenant acme created" in created.stdout, created.stderr
    listed = await keel_cli("tenants", "list", env=env)
    assert "acme\tAcme" in listed.stdout.splitlines()

    made = await keel_cli("keys", "create", "--tenant", "acme", "--admin", env=env)
    assert made.returncode == 0, made.stderr
    lines = made.stdout.splitlines()
    assert lines[0].startswith("key key_") and "of tenant acme (admin)" in lines[0]
    new_key = lines[1]
    assert "will not be shown again" in lines[2]
    key_id = lines[0].split()[1]

    # The new key works, for its own tenant.
    own = await keel_cli("loadout", "get", "--json", env=_env(running, new_key))
    assert own.returncode == 0, own.stderr
    keys = json.loads((await keel_cli("keys", "list", "--json", env=env)).stdout)
    assert any(k["id"] == key_id and k["tenant"] == "acme" for k in keys)
    assert new_key not in json.dumps(keys)

    revoked = await keel_cli("keys", "revoke", key_id, env=env)
    assert revoked.returncode == 0 and f"key {key_id} revoked" in revoked.stdout

    async def refused() -> str | None:
        result = await keel_cli("loadout", "get", env=_env(running, new_key))
        return _one_error_line(result) if result.returncode != 0 else None

    line = await eventually(refused, "the revoked key to be refused", 30)
    assert line.startswith("keel: the key was refused"), line
    assert (
        await http.get("/v1/loadout", headers={"Authorization": f"Bearer {new_key}"})
    ).status_code == 401


async def test_without_a_key_or_a_keel_one_clear_line(running: RunningKeel) -> None:
    where = {"KEEL_DATA_DIR": str(running.data_dir)}
    for command in (
        ["loadout", "get"],
        ["keys", "list"],
        ["tenants", "create", "x"],
        ["status"],
        ["drain"],
        ["chat"],
    ):
        result = await keel_cli(*command, env=where)
        assert (result.returncode, result.stderr, result.stdout) == (2, NO_KEY_LINE, ""), command

    nowhere = f"http://127.0.0.1:{free_port()}"
    result = await keel_cli("loadout", "get", "--url", nowhere, "--key", KEY)
    assert _one_error_line(result) == f"keel: no Keel at {nowhere} — is `keel up` running?"
    assert result.returncode == 1
    wrong = await keel_cli("loadout", "get", env=_env(running, "not-a-key-of-this-keel"))
    assert _one_error_line(wrong).startswith("keel: the key was refused")
    plain_key = (await keel_cli("keys", "create", "--json", env=_env(running))).stdout
    plain = await keel_cli("tenants", "list", env=_env(running, json.loads(plain_key)["key"]))
    assert "operator key" in _one_error_line(plain)


async def test_keel_up_processes_is_found_and_unannounced_when_it_stops(tmp_path: Path) -> None:
    # --processes: the supervisor picks the edge's port and announces it.
    with keel_up(tmp_path / "data", KEY, "--processes") as up:
        record = json.loads(up.discovery_file.read_text())
        assert record["pid"] == up.child.pid and record["grpc"]
        status = await keel_cli("status", env=_env(up))
        assert status.returncode == 0, status.stderr
        assert "runner" in status.stdout and "edge" in status.stdout
    assert not up.discovery_file.exists()
    gone = await keel_cli("status", "--data-dir", str(up.data_dir), "--url", up.url, "--key", KEY)
    assert _one_error_line(gone) == f"keel: no Keel at {up.url} — is `keel up` running?"


def _editor(replacement: str) -> str:
    """An $EDITOR that rewrites the file it is given to `replacement`."""
    script = f"import sys, pathlib; pathlib.Path(sys.argv[1]).write_text({replacement!r})"
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}"


async def test_loadout_edit_stores_what_the_editor_left(
    running: RunningKeel, http: httpx.AsyncClient
) -> None:
    before = (await http.get("/v1/loadout")).json()["revision"]
    edited = await keel_cli(
        "loadout", "edit", env={**_env(running), "EDITOR": _editor("systemPrompt: edited\n")}
    )
    assert edited.returncode == 0, edited.stderr
    assert f"loadout revision {before + 1} stored" in edited.stdout
    assert (await http.get("/v1/loadout")).json() == {
        "revision": before + 1,
        "document": {"systemPrompt": "edited"},
    }
    refused = await keel_cli(
        "loadout", "edit", env={**_env(running), "EDITOR": _editor("model: {provider: 7}\n")}
    )
    assert "model.provider" in _one_error_line(refused)
    assert (await http.get("/v1/loadout")).json()["revision"] == before + 1
