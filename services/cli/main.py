"""`keel`: run Keel's services, talk to them, and measure them.

keel up                    every service in one process (SQLite, offline model, web page)
keel ledger|kernel|…       one service in this process
keel bench ledger|…        a benchmark; prints one JSON object
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Coroutine
from typing import Annotated, Any

import typer

from services.common import telemetry
from services.common.config import Settings

app = typer.Typer(
    name="keel",
    help="Keel: a durable runtime for long-running LLM agent sessions.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks. Each prints one JSON object.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", envvar="KEEL_DATABASE_URL", help="PostgreSQL URL"),
]
Address = Annotated[str, typer.Option("--address", help="host:port to listen on")]


def _settings(database_url: str | None = None) -> Settings:
    settings = Settings.from_env()
    if database_url is not None:
        settings = settings.with_overrides(database_url=database_url)
    return settings


def _serve(service: str, settings: Settings, main: Coroutine[Any, Any, None]) -> None:
    telemetry.configure(service, settings)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main)


@app.command()
def ledger(address: Address = "127.0.0.1:7101", database_url: DatabaseUrl = None) -> None:
    """Run the ledger service (session streams, the writer fence)."""
    from services.ledger.server import run_ledger

    settings = _settings(database_url)
    _serve("ledger", settings, run_ledger(settings, address))


def _print_json(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


JsonFlag = Annotated[bool, typer.Option("--json", help="one line of JSON")]


@bench_app.command("ledger")
def bench_ledger(database_url: DatabaseUrl = None, as_json: JsonFlag = False) -> None:
    """Durable appends through gRPC vs a raw INSERT+COMMIT loop (PostgreSQL)."""
    from bench.ledger import measure

    _print_json(measure(database_url), as_json)


@bench_app.command("compaction")
def bench_compaction(as_json: JsonFlag = False) -> None:
    """Compaction policy time for 1k / 10k-message sessions."""
    from bench.compaction_policy import measure

    _print_json({"benchmark": "compaction", **measure()}, as_json)


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":
    main()
