"""`keel loadout|tenants|keys`: a tenant's configuration, through the edge.

These talk to the edge's HTTP API (GET/PUT /v1/loadout, /v1/tenants,
/v1/keys) with an admin or operator key, and find the edge as every client
command does (services/cli/discovery.py). Every failure is one line on
stderr and a non-zero exit: a refused document names the field, an
unreachable edge says so, and nothing prints a traceback.

Loadouts are written in YAML or JSON (told apart by content) and always
sent as JSON; `get` prints YAML unless --json. An empty document (an empty
file, an emptied editor buffer) is never stored: it would reset the prompt,
the model and the tools. `set` refuses it; `edit` is cancelled, as `kubectl
edit` is. A document identical to the stored one stores nothing either.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import httpx
import typer
import yaml

from services.cli.discovery import fail, require_key, resolve_url

REQUEST_TIMEOUT_S = 30.0
NOT_SHOWN_AGAIN = "This key will not be shown again: store it now."

loadout_app = typer.Typer(
    help="The tenant's loadout (model, prompt, tools…).", no_args_is_help=True
)
tenants_app = typer.Typer(help="Tenants (operator key).", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (admin: your tenant's; operator: any).", no_args_is_help=True)

Url = Annotated[
    str | None,
    typer.Option("--url", help="edge URL (default: KEEL_URL, else the running `keel up`)"),
]
DataDir = Annotated[
    Path | None,
    typer.Option("--data-dir", help="where `keel up` runs (default $KEEL_DATA_DIR or ./.keel)"),
]
Key = Annotated[str | None, typer.Option("--key", help="API key (default: KEEL_API_KEY)")]
AsJson = Annotated[bool, typer.Option("--json", help="JSON instead of text")]


# ------------------------------------------------------------------ HTTP


class Edge:
    """The edge a command talks to, with its key; failures end the command."""

    def __init__(self, url: str | None, data_dir: Path | None, key: str | None) -> None:
        self.key = require_key(key)
        self.url = resolve_url(url, data_dir)

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}", **kwargs.pop("headers", {})}
        timeout = kwargs.pop("timeout", REQUEST_TIMEOUT_S)
        try:
            response = httpx.request(
                method, f"{self.url}{path}", headers=headers, timeout=timeout, **kwargs
            )
        except httpx.ConnectError:
            fail(f"keel: no Keel at {self.url} — is `keel up` running?")
        except httpx.TransportError as error:
            fail(f"keel: {self.url}: {error or type(error).__name__}")
        if response.is_error:
            fail(f"keel: {refusal(response)}")
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.call(method, path, **kwargs).json()


def refusal(response: httpx.Response) -> str:
    """The edge's refusal as one line: its message and the status."""
    try:
        error = response.json().get("error") or {}
        message = str(error.get("message") or response.reason_phrase)
    except (ValueError, AttributeError):
        message = response.reason_phrase or "error"
    message = " ".join(message.split())
    if response.status_code == 401:
        return f"the key was refused ({message})"
    return f"{message} (HTTP {response.status_code})"


# ------------------------------------------------------------------ documents


def parse_document(text: str, source: str) -> dict[str, Any]:
    """A loadout written as JSON or YAML, told apart by content: JSON starts
    with '{' (YAML would read most JSON too, but reports JSON errors badly)."""
    try:
        document = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except json.JSONDecodeError as error:
        fail(f"keel: {source} is not valid JSON: {error.msg} (line {error.lineno})")
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(error, "problem", None) or "unreadable"
        fail(f"keel: {source} is not valid YAML: {problem}{where}")
    if document is None:
        document = {}  # nothing but comments or blanks
    if not isinstance(document, dict):
        fail(f"keel: {source}: a loadout is a mapping of fields, not a {type(document).__name__}")
    return document


def as_yaml(document: dict[str, Any], revision: int) -> str:
    body = yaml.safe_dump(document, sort_keys=False, allow_unicode=True) if document else "{}\n"
    return f"# loadout revision {revision}\n{body}"


def current(edge: Edge) -> tuple[int, dict[str, Any]]:
    """The tenant's loadout as stored: (revision, document)."""
    answer = edge.json("GET", "/v1/loadout")
    return answer["revision"], answer["document"]


def put(edge: Edge, document: dict[str, Any], expected_revision: int = 0) -> int:
    headers = {"If-Match": f'"{expected_revision}"'} if expected_revision > 0 else {}
    answer = edge.json("PUT", "/v1/loadout", json=document, headers=headers)
    revision: int = answer["revision"]
    return revision


# ------------------------------------------------------------------ loadout


@loadout_app.command("get")
def loadout_get(
    as_json: AsJson = False, url: Url = None, data_dir: DataDir = None, key: Key = None
) -> None:
    """Print the tenant's loadout (YAML, or JSON with --json)."""
    answer = Edge(url, data_dir, key).json("GET", "/v1/loadout")
    if as_json:
        print(json.dumps(answer["document"], indent=2, ensure_ascii=False))
    else:
        print(as_yaml(answer["document"], answer["revision"]), end="")


@loadout_app.command("set")
def loadout_set(
    file: Annotated[Path, typer.Argument(help="the loadout, YAML or JSON ('-': stdin)")],
    if_match: Annotated[
        int, typer.Option("--if-match", help="store only if this is still the latest revision")
    ] = 0,
    url: Url = None,
    data_dir: DataDir = None,
    key: Key = None,
) -> None:
    """Store FILE as the tenant's next loadout revision."""
    edge = Edge(url, data_dir, key)
    source = "stdin" if str(file) == "-" else str(file)
    try:
        text = typer.get_text_stream("stdin").read() if source == "stdin" else file.read_text()
    except (OSError, UnicodeDecodeError) as error:
        fail(f"keel: cannot read {source}: {getattr(error, 'strerror', None) or error}")
    document = parse_document(text, source)
    if not document:
        fail(
            f"keel: {source} holds an empty loadout; nothing stored (it would reset the "
            "prompt, the model and the tools: write the fields you want out)"
        )
    revision, stored = current(edge)
    if document == stored and if_match in (0, revision):
        print(f"no change (the loadout is at revision {revision}); nothing stored")
        return
    revision = put(edge, document, if_match)
    print(f"loadout revision {revision} stored; the next attempt of each session uses it")


@loadout_app.command("edit")
def loadout_edit(url: Url = None, data_dir: DataDir = None, key: Key = None) -> None:
    """Edit the loadout in $EDITOR (as YAML) and store it; an emptied
    buffer cancels the edit."""
    edge = Edge(url, data_dir, key)
    revision, stored = current(edge)
    original = as_yaml(stored, revision)
    editor = shlex.split(os.environ.get("EDITOR") or "vi")
    with tempfile.TemporaryDirectory(prefix="keel-loadout-") as folder:
        path = Path(folder) / "loadout.yaml"
        path.write_text(original, encoding="utf-8")
        try:
            code = subprocess.call([*editor, str(path)])
        except OSError as error:
            fail(f"keel: cannot run the editor {editor[0]!r}: {error.strerror or error}")
        if code != 0:
            fail(f"keel: the editor exited with {code}; nothing stored")
        edited = path.read_text(encoding="utf-8")
    if edited == original:
        print("no change; nothing stored")
        return
    document = parse_document(edited, "the edited loadout")
    if not document:
        print("edit cancelled: the edited loadout is empty; nothing stored")
        return
    if document == stored:
        print("no change; nothing stored")
        return
    # If-Match: a change someone stored meanwhile is refused, not overwritten.
    new_revision = put(edge, document, revision)
    print(f"loadout revision {new_revision} stored; the next attempt of each session uses it")


# ------------------------------------------------------------------ tenants


@tenants_app.command("create")
def tenants_create(
    tenant_id: Annotated[str, typer.Argument(help="1-64 letters, digits or '_.-'")],
    name: Annotated[str, typer.Option("--name", help="a readable name")] = "",
    as_json: AsJson = False,
    url: Url = None,
    data_dir: DataDir = None,
    key: Key = None,
) -> None:
    """Create a tenant (idempotent)."""
    answer = Edge(url, data_dir, key).json(
        "POST", "/v1/tenants", json={"id": tenant_id, "name": name}
    )
    if as_json:
        print(json.dumps(answer))
    else:
        print(f"tenant {tenant_id} {'created' if answer['created'] else 'exists already'}")


@tenants_app.command("list")
def tenants_list(
    as_json: AsJson = False, url: Url = None, data_dir: DataDir = None, key: Key = None
) -> None:
    """Every tenant."""
    tenants = Edge(url, data_dir, key).json("GET", "/v1/tenants")["tenants"]
    if as_json:
        print(json.dumps(tenants))
        return
    for tenant in tenants:
        print(f"{tenant['id']}\t{tenant['name']}")


# ------------------------------------------------------------------ keys


@keys_app.command("create")
def keys_create(
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="default: your key's tenant")
    ] = None,
    admin: Annotated[bool, typer.Option("--admin", help="manages the tenant")] = False,
    operator: Annotated[
        bool, typer.Option("--operator", help="sees every tenant's runtimes and drains them")
    ] = False,
    as_json: AsJson = False,
    url: Url = None,
    data_dir: DataDir = None,
    key: Key = None,
) -> None:
    """Create an API key; it is printed this once."""
    body: dict[str, Any] = {"admin": admin, "operator": operator}
    if tenant:
        body["tenant"] = tenant
    answer = Edge(url, data_dir, key).json("POST", "/v1/keys", json=body)
    if as_json:
        print(json.dumps(answer))
        typer.echo(NOT_SHOWN_AGAIN, err=True)
        return
    roles = [r for r in ("admin", "operator") if answer[r]] or ["plain"]
    print(f"key {answer['id']} of tenant {answer['tenant']} ({', '.join(roles)}):")
    print(answer["key"])
    print(NOT_SHOWN_AGAIN)


@keys_app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option("--tenant", help="only this tenant's")] = None,
    as_json: AsJson = False,
    url: Url = None,
    data_dir: DataDir = None,
    key: Key = None,
) -> None:
    """API keys (their ids and rights; never the keys)."""
    params = {"tenant": tenant} if tenant else {}
    keys = Edge(url, data_dir, key).json("GET", "/v1/keys", params=params)["keys"]
    if as_json:
        print(json.dumps(keys))
        return
    for item in keys:
        roles = [r for r in ("admin", "operator") if item[r]] or ["plain"]
        state = "revoked" if item["revokedAtMs"] is not None else "valid"
        print(f"{item['id']}\t{item['tenant']}\t{','.join(roles)}\t{state}")


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="the key's id (keel keys list)")],
    url: Url = None,
    data_dir: DataDir = None,
    key: Key = None,
) -> None:
    """Revoke a key: every edge refuses it at once."""
    answer = Edge(url, data_dir, key).json("DELETE", f"/v1/keys/{quote(key_id, safe='')}")
    print(f"key {key_id} {'revoked' if answer['revoked'] else 'was revoked already'}")
