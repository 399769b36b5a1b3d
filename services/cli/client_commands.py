"""The commands that talk to a running Keel: `keel chat|drain|status|chaos`.

They find the edge by themselves (`--url`, KEEL_URL, else the running
`keel up` of the data dir) and authenticate with an API key; only
`keel drain --local` reaches this host's runtimes directly, with the
internal token. Apart from the commands that start services
(services/cli/main.py) because these start nothing; main.py registers them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from services.cli.admin import Edge
from services.cli.discovery import USAGE_EXIT, fail, require_key, resolve_url
from services.service_start import settings_from_env

BaseUrl = Annotated[
    str | None,
    typer.Option("--url", help="edge URL (default: KEEL_URL, else the running `keel up`)"),
]
ClientDataDir = Annotated[
    Path | None,
    typer.Option("--data-dir", help="where `keel up` runs (default $KEEL_DATA_DIR or ./.keel)"),
]
Key = Annotated[str | None, typer.Option("--key", help="API key (default: KEEL_API_KEY)")]


def chat(
    session: Annotated[str | None, typer.Option("--session", help="session id")] = None,
    url: BaseUrl = None,
    data_dir: ClientDataDir = None,
    key: Key = None,
) -> None:
    """Chat with a session in the terminal; resumes after disconnects."""
    from services.cli.chat import run_chat

    api_key = require_key(key)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_chat(resolve_url(url, data_dir), api_key, session))


def drain(
    mode: Annotated[str, typer.Option("--mode", help="handoff or shutdown")] = "handoff",
    deadline_ms: Annotated[
        int,
        typer.Option(
            "--deadline-ms",
            min=0,
            envvar="KEEL_DRAIN_DEADLINE_MS",
            help="how long a handoff waits for commit boundaries",
        ),
    ] = 30_000,
    runtime_id: Annotated[
        str | None, typer.Option("--runtime-id", help="one runtime (default: every runner)")
    ] = None,
    undo: Annotated[
        bool, typer.Option("--undo", help="undo drains that have not finished")
    ] = False,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="the runtimes recorded under --data-dir (this pod or host), drained "
            "directly with the internal token: no edge, no key (beside a running "
            "`keel up`: its runners only, as through the edge)",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="the edge's answer as JSON")] = False,
    url: BaseUrl = None,
    data_dir: ClientDataDir = None,
    key: Key = None,
) -> None:
    """Drain runners (or, --local, this host's runtimes); exit 1 if any could not be.

    Through the edge (operator key): --runtime-id drains one runtime, else every
    attached runner; a drained runner exits and is replaced. --undo undoes a drain
    that has not finished."""
    if mode not in ("handoff", "shutdown"):
        fail("keel drain: --mode must be handoff or shutdown", USAGE_EXIT)
    if local:
        _drain_local(mode, deadline_ms, runtime_id, undo, data_dir)
        return
    edge = Edge(url, data_dir, key)
    body: dict[str, Any] = {} if undo else {"mode": mode, "deadlineMs": deadline_ms}
    if runtime_id:
        body["runtimeId"] = runtime_id
    path = "/v1/runtime/drain/undo" if undo else "/v1/runtime/drain"
    result = edge.json("POST", path, json=body, timeout=deadline_ms / 1000 + 30)
    if as_json:
        print(json.dumps(result))
    elif undo:
        print(f"undone: {', '.join(result['undone']) or 'nothing was draining'}")
        if result["finished"]:
            print(f"too late (drain finished, being replaced): {', '.join(result['finished'])}")
    else:
        for drained, in_flight in sorted(result["runtimes"].items()):
            if drained in result.get("undone", ()):
                print(f"{drained}: drain undone before it finished; it claims again")
                continue
            stopped = result["stopped"].get(drained, 0)
            print(
                f"{drained}: drained ({mode}), {in_flight} run(s) in flight, "
                f"{stopped} stopped where they were"
            )
        if result.get("edge"):
            print(f"{result['edge']}: drained, {result.get('openStreams', 0)} stream(s) open")
        if not result["runtimes"] and not result.get("edge") and not result["failed"]:
            print("no runner is attached: nothing to drain")
    for failed, why in sorted(result["failed"].items()):
        print(f"keel drain: {failed}: {why}", file=sys.stderr)
    if result["failed"]:
        raise typer.Exit(1)


def _drain_local(
    mode: str, deadline_ms: int, runtime_id: str | None, undo: bool, data_dir: Path | None
) -> None:
    from services.cli.discovery import default_data_dir
    from services.cli.local_drain import LocalDrain, drain_local, local_settings
    from services.common.internal_auth import InternalAuthError

    folder = data_dir if data_dir is not None else default_data_dir()
    try:
        settings = local_settings(settings_from_env().with_overrides(data_dir=folder))
    except (InternalAuthError, OSError) as error:
        fail(f"keel drain --local: {error}")
    request = LocalDrain(mode, deadline_ms, folder, undo, runtime_id)
    lines, failures = asyncio.run(drain_local(request, settings))
    for line in lines:
        print(line, flush=True)
    for failure in failures:
        print(f"keel drain --local: {failure}", file=sys.stderr, flush=True)
    if failures:
        raise typer.Exit(1)


def status(
    url: BaseUrl = None,
    data_dir: ClientDataDir = None,
    key: Key = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="the edge's answer as one line of JSON (full ids)")
    ] = False,
) -> None:
    """Every runtime's state (admin key: your tenant's sessions; operator key: all).

    Ids are never cut: a pipe gets the table at full width; a narrow terminal
    gets one block per runtime."""
    from services.cli.status_view import print_status

    print_status(Edge(url, data_dir, key).json("GET", "/v1/runtime/status"), as_json)


JsonFlag = Annotated[bool, typer.Option("--json", help="one line of JSON")]


def chaos(
    url: BaseUrl = None,
    data_dir: ClientDataDir = None,
    key: Key = None,
    scenarios: Annotated[str, typer.Option(help="crash, handoff, stale")] = "crash,handoff",
    rounds: Annotated[int, typer.Option(min=1, help="rounds of each scenario")] = 2,
    sessions: Annotated[int, typer.Option(min=1, help="sessions driven at once")] = 6,
    seed: Annotated[int | None, typer.Option(help="fixes chaos's own choices")] = None,
    timeout_s: Annotated[float, typer.Option(min=1, help="wait for answers, per round")] = 120,
    as_json: JsonFlag = False,
) -> None:
    """Crash, hand off or stop runners as sessions run; exit 1 on any violation (operator key)."""
    import random

    from services.cli.chaos import ChaosOptions, parse_scenarios, run_command

    try:
        chosen = parse_scenarios(scenarios)
    except ValueError as error:
        fail(f"keel chaos: {error}", USAGE_EXIT)
    options = ChaosOptions(
        url=resolve_url(url, data_dir),
        key=require_key(key),
        scenarios=chosen,
        rounds=rounds,
        sessions=sessions,
        seed=random.randrange(1_000_000) if seed is None else seed,
        timeout_s=timeout_s,
    )
    raise typer.Exit(run_command(options, as_json))
