"""`keel bench …`: the benchmark commands, a typer app the `keel` command mounts.

Each command imports its benchmark when it runs, so `keel --help` (and every
other command) loads none of them. The benchmarks may use the CLI's building
blocks (`services.cli.up`, `services.cli.chaos`): bench sits above the CLI in
the layer contract (tests/test_import_directions.py), and the CLI imports
only this module of bench, to mount it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from services.common.heap import settle_heap

bench_app = typer.Typer(help="Benchmarks. Each prints one JSON object.", no_args_is_help=True)

# As the `keel` command's own options spell them.
DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", envvar="KEEL_DATABASE_URL", help="PostgreSQL URL"),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="one line of JSON")]


def _print_json(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


@bench_app.command("ledger")
def bench_ledger(database_url: DatabaseUrl = None, as_json: JsonFlag = False) -> None:
    """Durable appends through gRPC vs a raw INSERT+COMMIT loop (PostgreSQL)."""
    from bench.ledger import measure

    _print_json(measure(database_url), as_json)


@bench_app.command("kernel")
def bench_kernel(database_url: DatabaseUrl = None, as_json: JsonFlag = False) -> None:
    """Claims per second and SIGKILL-to-takeover latency."""
    from bench.cluster import DEFAULT_URL
    from bench.kernel import measure

    _print_json(measure(database_url or DEFAULT_URL), as_json)


@bench_app.command("takeover")
def bench_takeover(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    runner_kills: Annotated[int, typer.Option(min=1, help="runner SIGKILL trials")] = 50,
    node_losses: Annotated[int, typer.Option(min=1, help="whole-node loss trials")] = 5,
) -> None:
    """SIGKILL -> successor's first commit: a runner alone, and a whole node."""
    from bench.takeover import measure

    _print_json(measure(database_url, runner_kills, node_losses), as_json)


@bench_app.command("turns")
def bench_turns(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    sessions: Annotated[int, typer.Option(min=1, help="sessions running at once")] = 50,
    turns: Annotated[int, typer.Option(min=1, help="turns per session")] = 10,
    layout: Annotated[
        str,
        typer.Option(
            help="one: every service in this process; split: ledger, kernel and runner "
            "each in its own process, as keel up --processes",
        ),
    ] = "one",
) -> None:
    """Input committed -> final answer committed, concurrent sessions, instant model."""
    from bench.turns import measure

    if layout not in ("one", "split"):
        raise typer.BadParameter("one or split", param_hint="--layout")

    # Every service runs in this process here: its heap settled as keel up's.
    settle_heap()
    _print_json(measure(database_url, sessions, turns, layout=layout), as_json)


@bench_app.command("peers")
def bench_peers(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    peers: Annotated[str, typer.Option(help="langgraph,dbos, one of them, or none")] = (
        "langgraph,dbos"
    ),
    cache_dir: Annotated[
        Path | None, typer.Option(help="where the peers' scratch venv is kept")
    ] = None,
    one_session_turns: Annotated[int, typer.Option(min=1, help="turns of one session")] = 100,
    sessions: Annotated[int, typer.Option(min=1, help="sessions running at once")] = 50,
    turns: Annotated[int, typer.Option(min=1, help="turns per concurrent session")] = 10,
    dry_run: Annotated[bool, typer.Option(help="print the plan; install and run nothing")] = False,
    layout: Annotated[
        str, typer.Option(help="Keel's layout, as keel bench turns --layout: one or split")
    ] = "one",
) -> None:
    """The same turn on LangGraph, DBOS and Keel in one run (peers in a scratch venv)."""
    from bench.cluster import DEFAULT_URL
    from bench.peers import PeersOptions, measure, parse_peers, plan

    try:
        chosen = parse_peers(peers)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--peers") from error
    if layout not in ("one", "split"):
        raise typer.BadParameter("one or split", param_hint="--layout")
    options = PeersOptions(
        database_url or DEFAULT_URL,
        chosen,
        cache_dir,
        one_session_turns,
        sessions,
        turns,
        layout=layout,
    )
    if dry_run:
        _print_json(plan(options), as_json)
        return
    settle_heap()
    _print_json(measure(options), as_json)


@bench_app.command(
    "profile", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def bench_profile(
    ctx: typer.Context,
    benchmark: Annotated[str, typer.Argument(help="the benchmark: turns, ledger, e2e, …")],
    tool: Annotated[str, typer.Option(help="py-spy or cprofile")] = "py-spy",
    rate: Annotated[int, typer.Option(min=1, help="py-spy samples per second")] = 250,
    gil: Annotated[bool, typer.Option(help="py-spy: only threads holding the GIL")] = True,
    native: Annotated[bool, typer.Option(help="py-spy: C and Cython frames too")] = True,
    top: Annotated[int, typer.Option(min=1, help="functions listed")] = 25,
    raw: Annotated[
        Path | None, typer.Option(help="keep py-spy's collapsed stacks in this file")
    ] = None,
) -> None:
    """Runs a benchmark under py-spy (or cProfile): CPU by component, top functions.
    Options after the benchmark's name that are not these go to the benchmark
    (e.g. `keel bench profile turns --sessions 1 --turns 100`); see bench/profile.py."""
    from bench.profile import Options, profile

    options = Options(tool=tool, rate=rate, gil=gil, native=native, top=top, raw=raw)
    print(profile(benchmark, ctx.args, options))


@bench_app.command("timeline")
def bench_timeline(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    turns: Annotated[int, typer.Option(min=2, help="turns of the one session")] = 200,
) -> None:
    """Where one turn's wall-clock time goes: each step's median offset (bench/timeline.py)."""
    from bench.timeline import measure, render

    result = measure(database_url, turns)
    if as_json:
        _print_json(result, as_json)
    else:
        print(render(result))


@bench_app.command("rebuild")
def bench_rebuild(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    facts: Annotated[int, typer.Option(min=2, help="facts in the session")] = 10_000,
    runs: Annotated[int, typer.Option(min=3, help="measured rebuilds")] = 5,
) -> None:
    """A successor's cold rebuild of a long session: ledger Read of it all + model context."""
    from bench.rebuild import measure

    _print_json(measure(database_url, facts, runs), as_json)


@bench_app.command("fork")
def bench_fork(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    facts: Annotated[int, typer.Option(min=2, help="facts in the parent session")] = 10_000,
    runs: Annotated[int, typer.Option(min=3, help="measured forks")] = 5,
) -> None:
    """Forking a long session (rows copied by the database) against reading it."""
    from bench.fork import measure

    _print_json(measure(database_url, facts, runs), as_json)


@bench_app.command("e2e")
def bench_e2e(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    transport: Annotated[
        str, typer.Option("--transport", help="front door to time: http, grpc or both")
    ] = "both",
    processes: Annotated[
        bool, typer.Option("--processes", help="keel up --processes: a process per service")
    ] = False,
) -> None:
    """Input -> final answer through each front door; 1000 SSE clients on one edge."""
    from bench.e2e import TRANSPORTS, measure

    if transport != "both" and transport not in TRANSPORTS:
        raise typer.BadParameter("http, grpc or both", param_hint="--transport")
    _print_json(measure(database_url, transport=transport, processes=processes), as_json)


@bench_app.command("soak")
def bench_soak(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    sessions: Annotated[int, typer.Option(min=1, help="sessions, each with an SSE reader")] = 200,
    duration: Annotated[float, typer.Option(min=1, help="seconds of posting")] = 60.0,
) -> None:
    """POST /inputs latency while answers queue behind the tenant's run slots (bench/soak.py)."""
    from bench.soak import measure

    _print_json(measure(database_url, sessions, duration_s=duration), as_json)


@bench_app.command("drain")
def bench_drain(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    sessions: Annotated[int, typer.Option(min=1, help="sessions on the drained runner")] = 100,
) -> None:
    """Handoff drain of a runner holding N running sessions: reclaim time, duplicates."""
    from bench.drain import measure

    _print_json(measure(database_url, sessions), as_json)


@bench_app.command("replicas")
def bench_replicas(
    database_url: DatabaseUrl = None,
    as_json: JsonFlag = False,
    runs: Annotated[int, typer.Option(min=1, help="runs, each on a fresh `keel up`")] = 3,
    sessions: Annotated[int, typer.Option(min=1, help="sessions posting inputs")] = 8,
) -> None:
    """Inputs/s accepted while one of two ledger replicas is SIGKILLed (PostgreSQL)."""
    from bench.replicas import measure

    _print_json(measure(database_url, runs, sessions), as_json)


@bench_app.command("tools")
def bench_tools(
    as_json: JsonFlag = False,
    calls: Annotated[int, typer.Option(min=1, help="measured calls per source")] = 500,
) -> None:
    """Per-call overhead beyond the tool's own time: builtin, MCP stdio/HTTP, gRPC."""
    from bench.tools import measure

    _print_json({"benchmark": "tools", **measure(calls)}, as_json)


@bench_app.command("compaction")
def bench_compaction(as_json: JsonFlag = False) -> None:
    """Compaction policy time for 1k / 10k-message sessions."""
    from bench.compaction_policy import measure

    _print_json({"benchmark": "compaction", **measure()}, as_json)
