"""`keel config`: the configuration a Keel process started here would run with.

Every `KEEL_*` variable comes from the settings registry
(services.common.settings_registry): this prints each one's effective value
and where it came from (secrets masked), or the README's table with
`--markdown`. A `KEEL_*` variable the registry does not know is refused (exit
2, one line each with the nearest known name): a misspelt setting would
otherwise be ignored in silence.
"""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer

from services.cli.discovery import USAGE_EXIT
from services.common.settings_registry import declared
from services.common.settings_report import Effective, effective, markdown_table, unknown


def _readers(name: str) -> tuple[str, ...]:
    setting = declared(name)
    return setting.readers if setting is not None else ()


def _text_lines(values: list[Effective]) -> list[str]:
    width = max(len(item.name) for item in values)
    lines = []
    for item in values:
        value = item.value or ("(empty)" if item.source == "env" else "(unset)")
        note = f"  ! {item.error}" if item.error else ""
        lines.append(f"{item.name:<{width}}  {value}  [{item.source}]{note}")
    return lines


def show_config(
    as_json: Annotated[bool, typer.Option("--json", help="the same as JSON")] = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="print the README's table of every setting")
    ] = False,
    service: Annotated[
        str | None,
        typer.Option("--service", help="only the settings this part reads (e.g. runner, edge)"),
    ] = None,
    every: Annotated[
        bool, typer.Option("--all", help="the test and bench settings too, even unset")
    ] = False,
) -> None:
    """Print the effective configuration (KEEL_* variables, secrets masked);
    exit 2 on an unknown KEEL_* variable or a value that cannot be used."""
    if markdown:
        typer.echo(markdown_table(), nl=False)
        return
    env = dict(os.environ)
    values = effective(env, every_scope=every)
    if service is not None:
        values = [item for item in values if service in _readers(item.name)]
    strangers = unknown(env)
    if as_json:
        report = {
            "settings": [
                {"name": v.name, "value": v.value, "source": v.source}
                | ({"error": v.error} if v.error else {})
                for v in values
            ],
            "unknown": [{"name": u.name, "suggestion": u.suggestion} for u in strangers],
        }
        typer.echo(json.dumps(report, indent=2))
    else:
        for line in _text_lines(values) if values else []:
            typer.echo(line)
    for stranger in strangers:
        typer.echo(stranger.line(), err=True)
    if strangers or any(item.error for item in values):
        raise typer.Exit(USAGE_EXIT)
